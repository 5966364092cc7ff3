"""Everything a role needs from the spec, parsed once: the cluster spec plus the role-owned
sections (data, model, optimizer) and the table layout they imply.

Every role needs the table layout and row shape (PS shards size their arrays with it, the
oracle maps rows to keys, trainers build caches), so the sections are parsed here, once,
and a bad field fails every role at start-up with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.data.spec import DataSpec, parse_data_spec
from common.keys import TableLayout
from common.model_spec import ModelSpec, parse_model_spec
from common.optimizer_spec import OptimizerSpec, parse_optimizer_spec
from common.spec import ClusterSpec


@dataclass(frozen=True, kw_only=True)
class Job:
    spec: ClusterSpec
    data: DataSpec
    model: ModelSpec
    optimizer: OptimizerSpec
    layout: TableLayout
    num_dense: int

    @property
    def dim(self) -> int:
        return self.model.embedding_dim

    @property
    def state_width(self) -> int:
        return self.optimizer.state_width

    @property
    def state_init(self) -> float:
        """The optimizer state of a row never updated (Adagrad's initial accumulator)."""
        return self.optimizer.state_init


def build_job(spec: ClusterSpec) -> Job:
    """Parse the role-owned sections; table sizes the spec leaves to the data come from it."""
    from common.data import open_dataset

    data = parse_data_spec(spec.sections["data"], base_dir=spec.source.parent)
    model = parse_model_spec(spec.sections["model"])
    optimizer = parse_optimizer_spec(spec.sections["optimizer"])
    dataset = open_dataset(data)
    return Job(
        spec=spec,
        data=data,
        model=model,
        optimizer=optimizer,
        layout=TableLayout(tuple(dataset.table_sizes)),
        num_dense=dataset.num_dense,
    )
