"""trajmesh: fully asynchronous RL for language-model agents, built as a service mesh."""

__version__ = "0.1.0"
