"""The shared harness of the benchmarks: every script measures, checks and reports the same way.

Modules, one concept each:

- `args`: command lines (the shared flags, `--quick`, lists and names).
- `models`: the default model, a tokenizer, random-weight Llamas, the prompt text.
- `machine`: what the run ran on (CPU kind, cores, memory, versions).
- `load`: whether the machine was quiet (`LoadMonitor` and its noisy rule; `LoadRange`).
- `running`: worker threads, `Sample`, interleaved repeats with a warm-up.
- `children`: fresh processes importing contbatch from a given source tree.
- `stats`: medians with [min, max] (`Spread`) and ratios of them.
- `tokens`: greedy reference tokens and the check every posted row passes.
- `ceilings`: the machine's matmul rate and weight-read bandwidth, the floors' basis.
- `reports`: markdown tables, the report header, JSON output, recording in RESULTS.md.

Scripts `import harness as H` and use the names re-exported here.
"""

from .args import add_common_args, add_model_args, comma_list, parse, parser
from .ceilings import CEILING, ceiling_probe, matmul_rate, non_embedding_params, weight_read_bandwidth
from .children import child_env, emit, parse_named, run_child
from .load import NOISE_THRESHOLD, LoadMonitor, LoadRange, load_line, noisy_rule, wait_for_quiet
from .machine import cpu_model, machine_info, machine_line
from .models import default_tokenizer, dtype_of, load, random_llama, source_text
from .reports import Table, command_line, log, md_table, record_run, report_header, strip_private, write_outputs
from .running import Sample, cleanup, in_worker, interleaved_order, rounds, run_interleaved
from .stats import Spread, fmt_ratio, ratio, spreads
from .tokens import check_label, check_tokens, reference_tokens, same_tokens, worst_check

__all__ = [
    "CEILING", "NOISE_THRESHOLD", "LoadMonitor", "LoadRange", "wait_for_quiet", "Sample", "Spread", "Table", "add_common_args", "add_model_args", "ceiling_probe",
    "check_label", "check_tokens", "child_env", "cleanup", "comma_list", "command_line", "cpu_model",
    "default_tokenizer", "dtype_of", "emit", "fmt_ratio", "in_worker", "interleaved_order", "load", "load_line",
    "log", "machine_info", "machine_line", "matmul_rate", "md_table", "noisy_rule", "non_embedding_params",
    "parse", "parse_named", "parser", "random_llama", "ratio", "record_run", "reference_tokens", "report_header",
    "rounds", "run_child", "run_interleaved", "same_tokens", "source_text", "spreads", "strip_private",
    "weight_read_bandwidth", "worst_check", "write_outputs",
]
