"""Weight-only quantized linear layers on the CPU: the packed format (`format.py`) and the layer
that runs it (`linear.py`, on `ops.quant_linear`), and a token embedding looked up from a packed
table (`embedding.py`). Which layers of a model are quantized, from
a float model or from a GGUF file's own blocks, is decided in setup/ (`quantize.py`,
`gguf_quant.py`)."""
