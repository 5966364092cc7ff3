"""Everything a role needs from the spec, parsed once: the cluster spec plus the role-owned
sections (data, model, optimizer) and the facts of the data they imply.

Every role needs the table layout and row shape (PS shards size their arrays with it, the
oracle maps rows to keys, trainers build caches), so the sections are parsed here, once,
and a bad field fails every role at start-up with the same message. Only the oracle reads
the data (`build_job`); a role started with just the coordinator's address gets the same
job from it (`job_from_facts`), and never needs the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from common.data.spec import DataSpec, parse_data_spec
from common.keys import TableLayout
from common.model_spec import ModelSpec, parse_model_spec
from common.optimizer_spec import OptimizerSpec, parse_optimizer_spec
from common.spec import ClusterSpec

if TYPE_CHECKING:
    from common.data.dataset import Dataset


#: A stream's `DataFacts.iterations`: the most it may run. Its end is decided while it runs
#: (`train.max_iterations`, the oracle's ``--until``, or a stop), so the roles that never read
#: it take this bound, which versions and checkpoints stay below.
OPEN_END = 1 << 40


@dataclass(frozen=True, kw_only=True)
class DataFacts:
    """What the roles that never open the data need to know of it."""

    table_sizes: tuple[int, ...]
    num_dense: int
    iterations: int  # N: the run's length; its final snapshot is checkpoint N


@dataclass(frozen=True, kw_only=True)
class Job:
    spec: ClusterSpec
    data: DataSpec
    model: ModelSpec
    optimizer: OptimizerSpec
    facts: DataFacts

    @cached_property
    def layout(self) -> TableLayout:
        return TableLayout(self.facts.table_sizes)

    @property
    def num_dense(self) -> int:
        return self.facts.num_dense

    @property
    def iterations(self) -> int:
        """The run's length N: write-backs carry iterations below N and the final snapshot
        is checkpoint N (`trainer.final`), so no request of this run names a larger version."""
        return self.facts.iterations

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

    @property
    def state_min(self) -> float | None:
        """The least value a row's optimizer state may hold (None: any finite value)."""
        return self.optimizer.state_min


def build_job(spec: ClusterSpec, *, dataset: Dataset | None = None) -> Job:
    """Parse the role-owned sections and read the data's facts (table sizes the spec leaves
    to the data, the run's length) from the data itself: `dataset`, when the caller has
    opened it already (the launcher, converting in the background). A stream's
    (`data.watch`) come from the spec, its length bounded by `OPEN_END`."""
    from common.data import open_dataset

    data = parse_data_spec(spec.sections["data"], base_dir=spec.source.parent)
    train = spec.train
    if data.watch:  # a stream: nothing to open yet, and an end decided while it runs
        from common.data.convert import num_dense_of

        _check_stream_epochs(train.epochs)
        facts = DataFacts(table_sizes=data.table_sizes, num_dense=num_dense_of(data), iterations=OPEN_END)
        return job_from_facts(spec, facts, data=data)
    dataset = dataset or open_dataset(data)
    total = dataset.num_batches(train.batch_size, train.epochs)
    facts = DataFacts(
        table_sizes=tuple(dataset.table_sizes),
        num_dense=dataset.num_dense,
        iterations=min(total, train.max_iterations) if train.max_iterations else total,
    )
    return job_from_facts(spec, facts, data=data)


def _check_stream_epochs(epochs: int) -> None:
    from common.errors import ConfigError

    if epochs != 1:
        raise ConfigError("train.epochs", f"a stream is read once, as its rows arrive: set 1, got {epochs}")


def job_from_facts(spec: ClusterSpec, facts: DataFacts, *, data: DataSpec | None = None) -> Job:
    """The job of `spec` whose data has `facts`, without opening the data."""
    return Job(
        spec=spec,
        data=data or parse_data_spec(spec.sections["data"], base_dir=spec.source.parent),
        model=parse_model_spec(spec.sections["model"]),
        optimizer=parse_optimizer_spec(spec.sections["optimizer"]),
        facts=facts,
    )
