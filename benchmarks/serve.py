"""Load-test an OpenAI-compatible server: the same as `contbatch bench serve`.

    contbatch serve &                       # or vLLM, or `transformers serve`
    python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --request-rate 1 2 4 inf

See `contbatch/bench/` for what is measured and how.
"""

import sys

from contbatch.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
