"""Exports of a running job (serving/chain.py): a base, then deltas of the rows changed since
the link before; the chain read back is bit for bit the full export of its last checkpoint,
and scores the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from common.checkpoints import dense_path, ps_dir, write_manifest
from common.data.dataset import open_dataset
from common.init import initial_rows
from common.job import Job
from launcher.inprocess import FinalModel
from ps.checkpoint import save_snapshot
from ps.store import Snapshot
from serving.chain import CHAIN_FILE, DELTA_FILE, ExportChain, export_link, index_key
from serving.export import export_model
from serving.predict import every_batch, load_export, score
from serving.safetensors import FormatError
from serving.sources import open_checkpoint
from tests.serving.conftest import job_in

C1, C2, C3 = 3, 7, 11


def save_versioned(job: Job, model: FinalModel, c: int, versions: np.ndarray) -> None:
    """Checkpoint `c` of `model`, each written row at its version in `versions` (per key)."""
    spec, layout, shards = job.spec, job.layout, job.spec.ps.num_shards
    keys = np.arange(layout.total_rows, dtype=np.int64)
    written = keys[versions >= 0]
    for s in range(shards):
        mine = written[written % shards == s]
        snap = Snapshot(local=mine // shards, rows=model.table[mine], state=model.state[mine],
                        versions=versions[mine])
        save_snapshot(ps_dir(spec.checkpoint.dir, s), c, snap, {"shard": s, "num_shards": shards})
    dense = dense_path(spec.checkpoint.dir, c)
    dense.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.dense, "optimizer": {}, "iteration": c}, dense)
    write_manifest(spec.checkpoint.dir, c, shards, {})


def evolve(job: Job, model: FinalModel, versions: np.ndarray, c: int, seed: int) -> tuple[FinalModel, np.ndarray]:
    """`model` after some rows changed at iteration `c` (and the dense parameters)."""
    rng = np.random.default_rng(seed)
    changed = rng.random(job.layout.total_rows) < 0.05
    table, state = model.table.copy(), model.state.copy()
    table[changed] += rng.standard_normal((int(changed.sum()), job.dim)).astype(np.float32)
    state[changed] += 1.0
    dense = {k: v + 0.01 * (seed + 1) for k, v in model.dense.items()}
    return FinalModel(dense, table, state), np.where(changed, c, versions)


@pytest.fixture
def three_checkpoints(tmp_path: Path, trained: FinalModel) -> tuple[Job, list[FinalModel], list[np.ndarray]]:
    job = job_in(tmp_path)
    keys = np.arange(job.layout.total_rows, dtype=np.int64)
    versions = np.where((trained.table != initial_rows(job.layout, job.spec.seed, keys, job.dim)).any(axis=1), C1, -1)
    models, all_versions = [trained], [versions]
    for c, seed in ((C2, 1), (C3, 2)):
        model, versions = evolve(job, models[-1], all_versions[-1], c, seed)
        models.append(model)
        all_versions.append(versions)
    for c, model, versions in zip((C1, C2, C3), models, all_versions, strict=True):
        save_versioned(job, model, c, versions)
    return job, models, all_versions


def test_a_chain_is_a_base_then_deltas_of_the_changed_rows(tmp_path: Path, three_checkpoints: tuple) -> None:
    job, models, versions = three_checkpoints
    folder = tmp_path / "exports"
    links = [export_link(job, c, folder, chunk_rows=100) for c in (C1, C2, C3)]
    assert [(x.kind, x.checkpoint) for x in links] == [("base", C1), ("delta", C2), ("delta", C3)]
    assert ExportChain.read(folder).links == tuple(links)
    delta = load_file(folder / links[2].folder / DELTA_FILE)
    changed = np.flatnonzero(versions[2] > C2)
    offsets = job.layout.offsets
    got = np.concatenate([delta[index_key(t)] + offsets[t] for t in range(job.layout.num_tables)])
    assert np.array_equal(got, changed) and links[2].rows == changed.size  # only the rows changed since C2


def test_a_chain_reads_back_as_the_full_export_of_its_last_checkpoint(tmp_path: Path, three_checkpoints: tuple) -> None:
    job, models, _ = three_checkpoints
    for c in (C1, C2, C3):
        export_link(job, c, tmp_path / "exports", chunk_rows=64)
    export_model(open_checkpoint(job, C3), tmp_path / "full", chunk_rows=64)
    chain, full = load_export(tmp_path / "exports"), load_export(tmp_path / "full")
    for got, want in zip(chain.tables, full.tables, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    for key, value in full.model.state_dict().items():
        assert torch.equal(chain.model.state_dict()[key], value), key
    assert chain.manifest.origin.iterations == C3 + 1
    data = open_dataset(job.data)
    batches = list(every_batch(data, 64))
    a, b = score(chain, batches), score(full, batches)
    assert (a.auc, a.log_loss) == (b.auc, b.log_loss)
    for batch in batches[:3]:
        assert np.array_equal(chain.probabilities(batch), full.probabilities(batch))


def test_a_link_is_not_in_the_chain_until_whole(tmp_path: Path, three_checkpoints: tuple,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    job, _, _ = three_checkpoints
    folder = tmp_path / "exports"
    export_link(job, C1, folder, chunk_rows=64)
    before = (folder / CHAIN_FILE).read_bytes()

    def broken(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("serving.chain.write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        export_link(job, C2, folder, chunk_rows=64)
    assert (folder / CHAIN_FILE).read_bytes() == before
    with pytest.raises(ValueError, match="not after"):
        export_link(job, C1, folder, chunk_rows=64)
    (folder / CHAIN_FILE).write_text("{")
    with pytest.raises(FormatError, match="malformed"):
        ExportChain.read(folder)


def test_torchrecs_dlrm_loads_a_chain_as_the_full_export_of_its_last_checkpoint(
    tmp_path: Path, three_checkpoints: tuple
) -> None:
    pytest.importorskip("torchrec", reason="torchrec is optional: pip install --no-deps -r bench/requirements-torchrec.txt")
    from serving.torchrec_dlrm import keyed_features, load_torchrec_dlrm

    job, _, _ = three_checkpoints
    for c in (C1, C2, C3):
        export_link(job, c, tmp_path / "exports", chunk_rows=64)
    export_model(open_checkpoint(job, C3), tmp_path / "full", chunk_rows=64, torchrec=True)
    chain, full = load_torchrec_dlrm(tmp_path / "exports"), load_torchrec_dlrm(tmp_path / "full")
    for key, value in full.state_dict().items():
        assert torch.equal(chain.state_dict()[key], value), key
    batch = next(every_batch(open_dataset(job.data), 64))
    chain.eval(), full.eval()
    with torch.no_grad():
        dense = torch.from_numpy(np.array(batch.dense))
        assert torch.equal(chain(dense, keyed_features(batch.sparse)), full(dense, keyed_features(batch.sparse)))
