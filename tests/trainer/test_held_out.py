"""The held-out evaluation takes the oracle's read-only batches without a warning."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.cluster_helpers import write_spec
from tests.common.data.conftest import KAGGLE

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter: torch warns about a read-only array once per process, so an earlier
# test in this one could have used the warning up. The batches go through the wire codec
# as the oracle sends them (GET /v1/eval): decoded arrays are read-only views of the bytes.
HELD_OUT = textwrap.dedent(
    """
    import sys
    import warnings
    from pathlib import Path

    from common.data import open_dataset
    from common.job import build_job
    from common.spec import load_spec
    from common.steps import EvalBatch
    from launcher.inprocess import process_groups
    from trainer.collectives import Collectives
    from trainer.device import select_device
    from trainer.final import predict_held_out
    from trainer.startup import build_engine, seeded_model

    job = build_job(load_spec(Path(sys.argv[1])))
    device = select_device("cpu", 0)
    comm = Collectives(world_size=1, rank=0, group=process_groups(1)[0])
    engine = build_engine(job, device, comm, None, seeded_model(job, device))
    batches = [
        EvalBatch.from_wire(EvalBatch(keys=job.layout.to_keys(b.sparse), dense=b.dense, labels=b.labels).to_wire())
        for b in open_dataset(job.data).eval_batches(job.spec.train.batch_size)
    ]
    warnings.simplefilter("error")
    labels, _ = predict_held_out(batches, engine).arrays()
    print(labels.size)
    """
)


def test_the_held_out_evaluation_warns_of_nothing(tmp_path: Path) -> None:
    data = {"format": "criteo", "path": str(KAGGLE.resolve()), "table_sizes": [50] * 26, "eval_fraction": 0.1}
    spec = write_spec(tmp_path, "held-out", {"oracle": {"mode": "local"}, "trainers": {"count": 1}}, data=data)
    done = subprocess.run(
        [sys.executable, "-c", HELD_OUT, str(spec)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["800"]  # every held-out row of the 8,000 was scored
