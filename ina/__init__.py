"""ina: the worker side of the in-network aggregation emulator (codecs, wire format, client)."""
__version__ = "0.1.0"


def __getattr__(name):
    # lazy, so that `import ina.wire` does not load numba and the codecs
    if name == "Client":
        from .client import Client
        return Client
    if name == "AllreduceError":
        from .errors import AllreduceError
        return AllreduceError
    raise AttributeError(name)
