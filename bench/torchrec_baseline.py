"""TorchRec as a baseline for `bench/e2e.py`: the same job trained by TorchRec's model parallelism.

What is the same as in the bagpipe modes: the spec (table sizes, embedding dim, dense model
and its seed, optimizers and their lr/eps, global batch, iterations), the batches (the
oracle's `build_workload`, each rank its contiguous slice of B/T samples of the global batch,
as `common.steps.trainer_steps` gives our trainers), T processes with `trainers.threads`
intra-op threads each over gloo, and the records and summary (`launcher.summary.summarise`
with the caller's warm-up), so the figures line up with the modes'.

What TorchRec does its own way: `DistributedModelParallel` shards an `EmbeddingBagCollection`
(one table per feature, sum pooling of the one id per sample) table-wise over the ranks with
FBGEMM's fused CPU kernel, which applies EXACT_ROWWISE_ADAGRAD during backward. Forward
sends the ids to the tables' owners and the pooled rows back (two all-to-alls); backward
sends the gradients back, updates the rows in place, and DDP averages the dense gradients.
The embedding gradient a table's owner receives is the sum of the ranks' gradients of their
own mean losses: T times ours (`trainer/optim.py` divides by T). Row-wise Adagrad divides
by the root of the accumulated squares, so the updates are the same up to `eps`.

The dense model is our `trainer.models` DLRM fed with the pooled rows, not
`torchrec.models.dlrm.DLRM`: theirs is the same arithmetic (bottom MLP with a final ReLU, dot
products of the upper triangle without self pairs, top MLP ending in a plain linear layer),
but ours is built from the same seed in the same order, so both sides run identical dense
parameters and any difference in time is the embedding path and its communication.

The batches are made (as tensors and `KeyedJaggedTensor`s) before the clock starts, so
TorchRec does not pay for data generation; our trainers receive theirs from the oracle. It is
plain `DistributedModelParallel` training, not `TrainPipelineSparseDist`, which would
overlap the ids' all-to-all with the previous iteration's compute.

torchrec is optional (`bench/requirements-torchrec.txt`); `unavailable()` says why it cannot
be imported, and only the spawned ranks import it.

`run` spawns every rank here; one rank alone, for ranks on different hosts (`bench/cluster.py`):

    python -m bench.torchrec_baseline SPEC --rank R --run-dir DIR --init-method tcp://HOST:PORT
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from common.job import Job, build_job
from common.runtime import pin_process, pinned_cpus
from common.spec import load_spec
from launcher.memory import RSS_FILE, RssRecorder
from launcher.summary import RunSummary, summarise
from oracle.startup import build_workload
from trainer.collectives import calm_gloo_loops
from trainer.models import build_model
from trainer.optim import build_dense_optimizer
from trainer.records import FinalRecord, IterationRecord, RecordWriter, ThreadsRecord, read_run
from trainer.threads import THREADS_EVERY, ThreadClock
from trainer.timing import PhaseTimer

if TYPE_CHECKING:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

RSS_POLL_S = 0.2  # as the launcher polls its roles
INSTALL = "pip install --no-deps -r bench/requirements-torchrec.txt"
MODE = "torchrec"


def unavailable() -> str | None:
    """Why TorchRec cannot run here (with the command that installs it), or None if it can."""
    try:
        import torchrec.distributed  # noqa: F401
    # An fbgemm build that does not match torch fails to load its library: OSError or RuntimeError.
    except (ImportError, OSError, RuntimeError) as exc:
        return (f"torchrec is not importable ({exc}); install it with `{INSTALL}` "
                "(never without --no-deps: it would replace torch)")
    return None


class PooledDLRM(nn.Module):
    """Our dense model over the pooled rows of an `EmbeddingBagCollection` (a feature a table)."""

    def __init__(self, tables: nn.Module, dense: nn.Module, dim: int) -> None:
        super().__init__()
        self.tables = tables
        self.dense = dense
        self.dim = dim

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.tables(sparse).values()  # (b, F * d), features in table order
        return self.dense(dense, pooled.view(pooled.shape[0], -1, self.dim))  # (b,)


def run(spec_path: Path, run_dir: Path, *, warmup: int) -> RunSummary:
    """Train the job of `spec_path` with TorchRec in `trainers.count` spawned ranks, writing
    trainer records and the ranks' RSS and CPU time (`launcher.memory`) into `run_dir`, and
    summarise them like a mode's run."""
    job = build_job(load_spec(spec_path))
    world = job.spec.trainers.count
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in (*run_dir.glob("trainer-*.jsonl"), run_dir / "rendezvous", run_dir / RSS_FILE):
        old.unlink(missing_ok=True)  # records append and the file store must start empty
    ranks = mp.spawn(_rank_main, args=(spec_path, run_dir), nprocs=world, join=False)
    # Each rank's RSS and CPU time, sampled as the launcher samples a mode's roles.
    recorder = RssRecorder(run_dir / RSS_FILE)
    while not ranks.join(timeout=RSS_POLL_S):
        recorder.sample((f"trainer-{rank}", p.pid) for rank, p in enumerate(ranks.processes))
    return summarise(read_run(run_dir, world), mode=MODE, global_batch=job.spec.train.batch_size,
                     warmup=warmup, trainers=world)


def _rank_main(rank: int, spec_path: Path, run_dir: Path, init_method: str | None = None) -> None:
    """One rank, to its end; `init_method` (default: a file store in `run_dir`, for ranks on
    one machine: no port to pick and race for) is where the ranks meet."""
    job = build_job(load_spec(spec_path))
    world = job.spec.trainers.count
    # On one machine, the cores our trainers keep to in a local cluster, for the same reasons.
    cpus = pinned_cpus(job.spec.trainers, rank) if init_method is None else None
    if cpus is not None:
        pin_process(cpus)
    torch.set_num_threads(job.spec.trainers.threads)
    rendezvous = init_method or (run_dir / "rendezvous").resolve().as_uri()
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    calm_gloo_loops()  # as our trainers do (trainer/collectives.py)
    records = RecordWriter(run_dir / f"trainer-{rank}.jsonl")
    try:
        batches = _local_batches(job, rank, world)
        model = _sharded_model(job, world)
        dense_optimizer = build_dense_optimizer(job.optimizer, model.module.dense.parameters())
        dist.barrier()  # the ranks start the clock together
        _train(model, dense_optimizer, batches, records)
        dist.barrier()
    finally:
        records.close()
        dist.destroy_process_group()


#: labels (b,), dense (b, num_dense), the ids of the F features.
Batch = tuple[torch.Tensor, torch.Tensor, "KeyedJaggedTensor"]


def _local_batches(job: Job, rank: int, world: int) -> list[Batch]:
    """This rank's slice of every global batch of the run, in training order."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    workload = build_workload(job)
    per = workload.batch_size // world
    mine = slice(rank * per, (rank + 1) * per)
    keys = [f"f{t}" for t in range(job.layout.num_tables)]
    batches = workload.dataset.train_batches(workload.batch_size, epochs=workload.epochs)
    out = []
    for batch in itertools.islice(batches, workload.num_iterations):
        sparse = np.ascontiguousarray(batch.sparse[mine].T)  # (F, b): a KJT is feature-major
        ids = KeyedJaggedTensor(keys=keys, values=torch.from_numpy(sparse).view(-1),
                                lengths=torch.ones(sparse.size, dtype=torch.int32))
        labels = torch.from_numpy(batch.labels[mine].copy())
        out.append((labels, torch.from_numpy(batch.dense[mine].copy()), ids))
    return out


def _sharded_model(job: Job, world: int) -> DistributedModelParallel:
    """`PooledDLRM` under `DistributedModelParallel`: tables table-wise on the fused CPU
    kernel with row-wise Adagrad in backward, the dense part under DDP as our trainers'."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import (
        DefaultDataParallelWrapper,
        DistributedModelParallel,
    )
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.types import ShardingType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    opt = job.optimizer
    if opt.embedding != "rowwise_adagrad" or opt.initial_accumulator != 0.0:
        raise ConfigError("optimizer.embedding", "the TorchRec baseline runs row-wise Adagrad "
                          "from a zero accumulator, as FBGEMM starts it")
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=job.dim, num_embeddings=n,
                                  feature_names=[f"f{t}"], pooling=PoolingType.SUM)
               for t, n in enumerate(job.layout.sizes)]
    # On the meta device: each rank allocates only its own tables, once sharded.
    tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    torch.manual_seed(job.spec.seed)  # as `trainer.startup.seeded_model`: the same dense parameters
    dense = build_model(job.model, job.num_dense, job.layout.num_tables)
    module = PooledDLRM(tables, dense, job.dim)
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": opt.embedding_lr,
        "eps": opt.eps,
    })
    table_wise = ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                      compute_kernels=[EmbeddingComputeKernel.FUSED.value])
    constraints = {c.name: table_wise for c in configs}
    topology = TopologyFactory.create_topology(TrainerConfig(world_size=world),
                                               kernel_config=KernelConfig(compute_device="cpu"))
    # A fixed reservation: the default heuristic one warns that it misjudges dense tensors.
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=job.spec.train.batch_size // world, constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    # static_graph off: our trainers use DDP's defaults.
    return DistributedModelParallel(
        module, device=torch.device("cpu"), plan=plan, sharders=[sharder],
        data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False),
    )


def _train(
    model: nn.Module,
    dense_optimizer: torch.optim.Optimizer,
    batches: list[Batch],
    records: RecordWriter,
) -> None:
    """The loop of `trainer.engine.Engine._train` with TorchRec's embeddings: the same phases,
    the same loss, one record per iteration in the trainers' format."""
    timer = PhaseTimer()
    world = dist.get_world_size()
    dense_bytes = sum(4 * p.numel() for p in dense_optimizer.param_groups[0]["params"]) if world > 1 else 0
    clock = ThreadClock()
    timer.restart()
    for x, (labels, dense, ids) in enumerate(batches):
        with timer.phase("forward"):
            loss = F.binary_cross_entropy_with_logits(model(dense, ids), labels)
        with timer.phase("backward"):
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with timer.phase("dense_optimizer"):
            dense_optimizer.step()
        # No PS traffic, cache or sync: every counter but the samples and DDP's is zero (its
        # all-to-alls are not counted here: bench/cluster.py sees them on the links).
        phases = timer.end_iteration()
        if (x + 1) % THREADS_EVERY == 0:  # the trainers' own sampling of their threads' CPU
            records.write(ThreadsRecord(iteration=x + 1, time=time.time(), cpu=clock()))
        records.write(IterationRecord(
            iteration=x, time=time.time(), samples=len(labels), loss=float(loss.detach()), uses=0, hits=0,
            fetch_rows=0, fetch_bytes=0, write_back_rows=0, write_back_bytes=0, sync_rows=0, sync_bytes=0,
            join_rows=0, dense_bytes=dense_bytes, phases=phases, compute_cpu=timer.compute_cpu,
        ))
    records.write(FinalRecord(time=time.time(), iterations=len(batches)))


def main(argv: list[str] | None = None) -> int:
    """One rank as a process of its own; the caller starts every rank and empties `--run-dir`
    of an earlier run's records (they append)."""
    parser = argparse.ArgumentParser(description="one TorchRec baseline rank")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True, help="where trainer-RANK.jsonl goes")
    parser.add_argument("--init-method", required=True, help="torch.distributed's, e.g. tcp://HOST:PORT")
    args = parser.parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    _rank_main(args.rank, args.spec, args.run_dir, args.init_method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
