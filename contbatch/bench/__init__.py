"""`contbatch bench serve`: an asyncio load generator for any OpenAI-compatible server.

    datasets.py  prompts: `random` (seeded lengths) and `shared-prefix`
    client.py    one streamed request, timed chunk by chunk
    runner.py    a load level: Poisson arrivals or fixed concurrency, with a progress bar
    report.py    throughput and latency statistics, JSON, and the latency-vs-load plot
    cli.py       the command line
"""
