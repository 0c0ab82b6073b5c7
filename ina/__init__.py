"""ina: the worker side of the in-network aggregation emulator (codecs, wire format, client)."""
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("Client", "AllreduceError"):
        from . import client
        return getattr(client, name)
    raise AttributeError(name)
