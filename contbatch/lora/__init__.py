"""LoRA adapters on one base model (docs/lora.md): PEFT files (`peft_files.py`), the registry of
resident and parked adapters (`registry.py`), a step's rows grouped by adapter (`segments.py`)
and the linear hooks that add each group's low-rank product (`hooks.py`). Requests on adapters
are handled by the engine (`engine/adapters.py`); this package imports no other contbatch
subpackage (the hooks are handed the step-context reader)."""
