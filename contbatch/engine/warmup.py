"""Compiled steps warmed up before the first real request pays for them, and a compiled step
that cannot run here turned into an eager one, loudly. Used by the manager (`start()`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tqdm.auto import tqdm

from ..requests import RequestStatus

logger = logging.getLogger("contbatch")


def warm_up(manager) -> None:
    """Compile before the first real request pays for it: a varlen step of two prompt
    chunks, decode steps of two rows and of one (with dynamic shapes one graph serves them
    all; with `dynamic=False` or a branch on the size, each is a compile of its own)."""
    t0 = time.perf_counter()
    vocab = manager.model.get_input_embeddings().num_embeddings
    length = max(2, min(manager.resolved_config.q_padding_interval_size + 6, manager.resolved_config.max_context - 4))
    prompt = [3 + i % max(1, vocab - 3) for i in range(length)]
    rounds = [[prompt, prompt[::-1]], [prompt[:1]]]
    try:
        with tqdm(total=len(rounds), desc="contbatch: compiling steps", unit="phase") as bar:
            for i, prompts in enumerate(rounds):
                ids = manager.add_requests(prompts, max_new_tokens=3 - i,
                                        request_ids=[f"contbatch-warmup-{i}-{j}" for j in range(len(prompts))])
                failed = [out.error for out in map(manager.get_result, ids) if out.status != RequestStatus.FINISHED]
                if failed:
                    compile_failed(manager, failed[0])
                    break
                bar.update(1)
    except ValueError as exc:  # e.g. a queue limit below the warm-up's requests: compile on first use
        logger.warning("contbatch: compiled steps not warmed up (%s); the first requests compile them", exc)
    except RuntimeError:  # stopped while warming: nothing to warm any more
        return
    logger.info("contbatch: compiled steps warmed up in %.1f s (%d compiles)", time.perf_counter() - t0,
                manager.core.runner.compiles)
    manager._warm.set()


def compile_failed(manager, error: str) -> None:
    """A compiled step that cannot run here (no C++ compiler, an unsupported op) must not
    fail every request: say so loudly, in the log and in `resolved_config`, and run eager."""
    message = f"compiled steps failed to run ({error}); running eager instead"
    logger.error("contbatch: %s", message)
    manager.core.runner.compiled = {}
    manager.resolved_config = dataclasses.replace(
        manager.resolved_config, decode_compile=None, varlen_compile=None,
        warnings=manager.resolved_config.warnings + (message,),
    )
