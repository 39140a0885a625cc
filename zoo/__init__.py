"""A model zoo of typed Equinox modules with a `checkpoint` field."""

from ._base import AbstractModel as AbstractModel
from ._layers import Dense as Dense, gelu as gelu
from ._loss import (
    cross_entropy as cross_entropy,
    set_loss_chunk_size as set_loss_chunk_size,
)
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
    "cross_entropy",
    "gelu",
    "set_loss_chunk_size",
    "shard",
    "shard_batch",
]
