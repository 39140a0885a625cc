"""A model zoo of typed Equinox modules with a `checkpoint` field."""

from ._base import AbstractModel as AbstractModel
from ._layers import Dense as Dense, gelu as gelu
from ._mlp import MLP as MLP
from ._residual_chain import ResidualChain as ResidualChain
from ._sharding import shard as shard, shard_batch as shard_batch
from ._transformer import Transformer as Transformer


__all__ = [
    "AbstractModel",
    "Dense",
    "MLP",
    "ResidualChain",
    "Transformer",
    "gelu",
    "shard",
    "shard_batch",
]
