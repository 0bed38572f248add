"""What every router is: a plan put on a model for the life of a manager, and taken back.

A router replaces forwards (of modules, or a modeling file's function) with ones that call our
kernels, and only for calls made inside an engine step: the user's own forward, backward or
`generate` on the same model, on any thread, runs the original code, and so does a compiled
step's trace unless the router says otherwise. Which calls are inside a step, and which step,
the router asks `contbatch.context` at each call (keeping its functions on the modules it
routes: a copy of the model made while a manager runs, by `copy.deepcopy` or pickle, takes
functions by reference). `install()` twice is one install; `uninstall()` leaves no attribute of ours on the
modules and puts every original back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Router(ABC):
    @abstractmethod
    def install(self) -> None:
        """Route the plan's modules (a no-op when installed already or when the plan routes nothing)."""

    @abstractmethod
    def uninstall(self) -> None:
        """Put every original back."""
