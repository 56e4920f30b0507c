"""``ExecutorError``, in a module of its own that imports nothing: with ``--engine-process`` a
TP rank's death crosses to the worker as this error, pickled by its module's name, and the
worker unpickles it on its event loop. Defined in engine.executor (which imports torch), it
imported torch there, 1-1.5 s in which the loop answered nothing, not even a health check, and
the worker learned of the death that much later."""


class ExecutorError(RuntimeError):
    """The executor can no longer run steps (a TP worker died or failed)."""
