"""Trainer(accelerator="mncore", devices=2): data parallel over torch.distributed (gloo, 2 ranks).

The 2-process runs are one user script (tests/lightning/ddp_script.py) launched twice: by
Lightning itself (it re-runs the script for rank 1) and by torchrun. Each rank saves what it
saw; these tests compare accelerator="mncore" with accelerator="cpu", strategy="ddp" rank by
rank within ATOL (1e-5): per-step losses, final weights (and BatchNorm buffers), logged and
sync_dist-reduced metrics, validate/test results over a ragged validation set, predictions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from mncore_lightning import MNCoreAccelerator, MNCoreDDPStrategy, MNCoreStrategy
from mncore_lightning.device_selection import rank_device
from tests.lightning.lightning_testing import ATOL, loader

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "tests.lightning.ddp_script"
LIGHTNING_RUNS = (
    "cpu",
    "mncore",
    "split",
    "cpu_acc",
    "mncore_acc",
    "split_acc",
    "mlsdk",
    "mncore_syncbn",
)
TORCHRUN_RUNS = (
    "cpu_bn",
    "mncore_bn",
    "cpu_bn_bcast",
    "mncore_bn_bcast",
    "cpu_bn_bcast_acc",
    "mncore_bn_bcast_acc",
    "cpu_manual",
    "mncore_manual",
    "collectives_o1",
)


def _launch(command: list[str], out: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # one thread per rank on a 2-core machine
        "MNCORE_PRESET": "O0",
        "MNCORE_DEVICE": "pfvm:cpu",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "device")]),  # as pytest's
    }
    env.pop("LOCAL_RANK", None)
    # a session of its own: on a hang, every rank is stopped with the launcher
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish in 300 s:\n{output[-6000:]}")
    assert process.returncode == 0, output[-8000:]


def _results(out: Path, run: str) -> list[dict]:
    return [torch.load(out / f"{run}-rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def lightning_launch(tmp_path_factory) -> Path:
    """The script started once, as a user would: Lightning starts rank 1 itself."""
    out = tmp_path_factory.mktemp("ddp_lightning")
    _launch([sys.executable, "-m", SCRIPT, str(out), *LIGHTNING_RUNS], out)
    return out


@pytest.fixture(scope="module")
def torchrun_launch(tmp_path_factory) -> Path:
    """The same script under `torchrun --nproc_per_node 2` (TorchElastic's environment)."""
    out = tmp_path_factory.mktemp("ddp_torchrun")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    # --standalone: torchrun binds a free port itself (a port picked here could be taken
    # before torchrun binds it)
    command += ["--standalone", "-m", SCRIPT, str(out), *TORCHRUN_RUNS]
    _launch(command, out)
    return out


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float32),
        torch.as_tensor(b, dtype=torch.float32),
        atol=ATOL,
        rtol=0,
        msg=what,
    )


def assert_parity(out: Path, reference: str, run: str) -> list[dict]:
    """`run` matches `reference` on both ranks: losses, weights, metrics, evaluation."""
    refs, gots = _results(out, reference), _results(out, run)
    for rank, (ref, got) in enumerate(zip(refs, gots, strict=True)):
        assert got["world_size"] == 2 and got["strategy"] == "MNCoreDDPStrategy"
        assert len(got["losses"]) == len(ref["losses"]) == 16  # 2 epochs x 8 batches per rank
        _close(got["losses"], ref["losses"], f"rank {rank} losses")
        assert ref["state"].keys() == got["state"].keys()
        for key in ref["state"]:
            _close(got["state"][key], ref["state"][key], f"rank {rank} {key}")
        for epoch, (m_ref, m_got) in enumerate(
            zip(ref["epoch_metrics"], got["epoch_metrics"], strict=True)
        ):
            assert m_ref.keys() == m_got.keys()
            for key in m_ref:
                _close(m_got[key], m_ref[key], f"rank {rank} epoch {epoch} {key}")
        for stage in ("validate", "test"):
            assert ref[stage][0].keys() == got[stage][0].keys()
            for key, value in ref[stage][0].items():
                _close(got[stage][0][key], value, f"rank {rank} {stage} {key}")
        _close(got["predict"], ref["predict"], f"rank {rank} predictions")
    # the ranks trained on different halves of the data, and agree on the weights
    assert gots[0]["losses"] != gots[1]["losses"]
    for key, value in gots[0]["state"].items():
        if "running" not in key and "num_batches" not in key:  # BatchNorm's stay per rank
            _close(gots[1]["state"][key], value, f"weights agree across ranks: {key}")
    return gots


# --- selection ------------------------------------------------------------------------------


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"devices": 2},
        {"devices": "2"},
        {"devices": [0, 1]},
        {"devices": 1, "num_nodes": 2},
        {"devices": 2, "strategy": "mncore_ddp"},
    ],
)
def test_several_devices_pick_the_ddp_strategy(kwargs):
    trainer = _trainer(accelerator="mncore", **kwargs)
    assert isinstance(trainer.strategy, MNCoreDDPStrategy)
    assert isinstance(trainer.accelerator, MNCoreAccelerator)
    assert trainer.world_size == 2
    assert trainer.num_nodes == kwargs.get("num_nodes", 1)
    assert trainer.strategy.split_step is False  # the emulator averages inside the graph


def test_one_device_keeps_the_single_device_strategy():
    assert type(_trainer(accelerator="mncore", devices=1).strategy) is MNCoreStrategy


@pytest.mark.parametrize("devices", [0, -1, "x", [], True, [1, 3]])
def test_bad_device_counts_are_refused(devices):
    with pytest.raises((ValueError, MisconfigurationException), match="devices"):
        _trainer(accelerator="mncore", devices=devices)


def test_each_rank_gets_its_own_device():
    assert rank_device("pfvm:cuda", 1) == "pfvm:cuda:1"
    assert rank_device("mncore2:auto", 3) == "mncore2:3"
    assert rank_device("pfvm:cpu", 1) == "pfvm:cpu"
    assert rank_device("mncore2:5", 1) == "mncore2:5"  # placed by the user


def test_split_step_is_a_strategy_flag():
    assert MNCoreDDPStrategy(split_step=True).split_step is True
    assert "split_step=True" in repr(MNCoreDDPStrategy(split_step=True))


# --- launched by Lightning ------------------------------------------------------------------


def test_lightning_launch_matches_cpu_ddp(lightning_launch):
    """In-graph all-reduce: the same results as DDP, and one compiled call per batch."""
    got = assert_parity(lightning_launch, "cpu", "mncore")
    # fit: 16 training batches + 2 epochs x 4 validation batches, each ONE compiled call
    assert [g["compiled_calls_fit"] for g in got] == [24, 24]
    assert [g["split_step"] for g in got] == [False, False]


def test_gradient_all_reduce_is_inside_the_training_graph(lightning_launch):
    for rank in (0, 1):
        graph = (lightning_launch / "codegen" / f"rank{rank}" / "train_0" / "graph.py").read_text()
        assert "_c10d_functional.all_reduce" in graph
        assert "_c10d_functional.wait_tensor" in graph
        validation = lightning_launch / "codegen" / f"rank{rank}" / "validate_0" / "graph.py"
        assert "_c10d_functional" not in validation.read_text()


def test_the_data_parallel_step_is_captured_by_dynamo(lightning_launch):
    """The in-graph all-reduce step (with accumulation, with SyncBatchNorm) and the split
    step's forward+backward (also on MLSDK) run on the TorchDynamo capture
    (steps/hooks.py) on every rank."""
    for run in ("mncore", "mncore_acc", "mncore_syncbn", "split", "split_acc", "mlsdk"):
        got = [g["train_capture"] for g in _results(lightning_launch, run)]
        assert got == ["dynamo", "dynamo"], run


def test_split_step_matches_cpu_ddp(lightning_launch):
    """Compiled forward+backward, host all-reduce, compiled update: the same results."""
    got = assert_parity(lightning_launch, "cpu", "split")
    assert [g["split_step"] for g in got] == [True, True]
    # two compiled calls per training batch (forward+backward, update) + 8 validation calls
    assert [g["compiled_calls_fit"] for g in got] == [40, 40]


def test_accumulation_matches_cpu_ddp(lightning_launch):
    """accumulate_grad_batches=2 with Adam: gradients averaged once per window, both paths."""
    assert_parity(lightning_launch, "cpu_acc", "mncore_acc")
    got = assert_parity(lightning_launch, "cpu_acc", "split_acc")
    assert [g["compiled_calls_fit"] for g in got] == [32, 32]  # 16 + 8 updates + 8 validation


def test_mlsdk_splits_the_step_on_each_ranks_board(lightning_launch):
    """On (the strict fake) MLSDK each rank drives its own board and the step is split."""
    got = assert_parity(lightning_launch, "cpu", "mlsdk")
    assert [g["device"] for g in got] == ["mncore2:0", "mncore2:1"]
    assert [g["split_step"] for g in got] == [True, True]
    for g in got:
        assert "Context.compile" in g["mlsdk_calls"]
        assert "Context.synchronize" in g["mlsdk_calls"]  # gradients to the host all-reduce


def test_checkpoint_resume_matches_one_fit(lightning_launch):
    """Rank 0 writes the checkpoint after every rank synchronized; both ranks resume from it."""
    for got in _results(lightning_launch, "mncore"):
        assert got["checkpoint_files"] == ["mncore-epoch1.ckpt"]
        for key, value in got["state"].items():
            _close(got["resumed_state"][key], value, f"resumed {key}")


class _GlobalBatches(Sampler):
    """Batches of 2 x BATCH: step k's is rank 0's batch k followed by rank 1's, as Lightning's
    DistributedSampler (shuffled, seed 0, reseeded per epoch) deals them out to 2 ranks. Each
    iteration is the next epoch."""

    def __init__(self, dataset, batch: int) -> None:
        self.dataset, self.batch, self.epoch = dataset, batch, -1

    def __iter__(self):
        self.epoch += 1
        shards = []
        for rank in (0, 1):
            sampler = DistributedSampler(self.dataset, num_replicas=2, rank=rank, shuffle=True)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        for k in range(0, len(shards[0]), self.batch):
            yield shards[0][k : k + self.batch] + shards[1][k : k + self.batch]

    def __len__(self) -> int:
        return len(self.dataset) // (2 * self.batch)


def _one_process_reference() -> tuple[list[float], dict, torch.nn.Module]:
    """What 2 ranks with SyncBatchNorm must compute, by definition: ONE process training the
    same model with BatchNorm on the concatenated batch (2 x BATCH: both ranks' samples of
    each step; DDP's average of the per-rank mean losses is the mean over it)."""
    from tests.lightning.ddp_script import BATCH, TRAIN, SyncedClassifier
    from tests.lightning.lightning_testing import LossCollector, make_dataset, trainer_kwargs

    L.seed_everything(0, verbose=False)
    model = SyncedClassifier(net="bn")
    collector = LossCollector()
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[collector], **trainer_kwargs())
    data = make_dataset(TRAIN)
    trainer.fit(model, DataLoader(data, batch_sampler=_GlobalBatches(data, BATCH)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return [loss.item() for loss in collector.losses], state, model


def test_sync_batchnorm_matches_batchnorm_on_the_global_batch(lightning_launch):
    """Trainer(sync_batchnorm=True), 2 ranks x batch 4: the losses (averaged over the ranks),
    weights and running statistics of one process training BatchNorm on batch 8, on both
    ranks; evaluation (eval mode: BatchNorm with the running statistics) agrees too."""
    from tests.lightning.ddp_script import VAL
    from tests.lightning.lightning_testing import make_dataset

    ref_losses, ref_state, ref_model = _one_process_reference()
    got = _results(lightning_launch, "mncore_syncbn")
    assert len(ref_losses) == len(got[0]["losses"]) == 16
    mean_losses = [(a + b) / 2 for a, b in zip(got[0]["losses"], got[1]["losses"], strict=True)]
    _close(mean_losses, ref_losses, "losses averaged over the ranks")
    val_x = make_dataset(VAL, seed=1).tensors[0]
    ref_model.eval()
    for rank, g in enumerate(got):
        assert g["strategy"] == "MNCoreDDPStrategy"
        assert g["state"].keys() == ref_state.keys()
        assert "net.1.running_var" in ref_state
        for key, value in ref_state.items():
            _close(g["state"][key], value, f"rank {rank} {key}")
        with torch.no_grad():  # this rank's validation shard (DistributedSampler, in turn)
            _close(g["predict"], ref_model(val_x[rank::2]), f"rank {rank} predictions")
    graph = lightning_launch / "codegen_mncore_syncbn" / "rank0" / "train_0" / "graph.py"
    text = graph.read_text()
    assert "_c10d_functional.all_gather_into_tensor" in text  # the forward's statistics
    assert text.count("_c10d_functional.all_reduce.") == 2  # backward's sums, the gradients


# --- launched by torchrun -------------------------------------------------------------------


def test_torchrun_launch_matches_cpu_ddp_with_per_rank_batchnorm(torchrun_launch):
    """BatchNorm statistics stay per rank, as DDP's with broadcast_buffers=False."""
    got = assert_parity(torchrun_launch, "cpu_bn", "mncore_bn")
    running = [key for key in got[0]["state"] if key.endswith("running_mean")]
    assert running
    assert not torch.equal(got[0]["state"][running[0]], got[1]["state"][running[0]])


@pytest.mark.parametrize("suffix", ["", "_acc"])
def test_torchrun_launch_matches_cpu_ddp_broadcasting_batchnorm_buffers(torchrun_launch, suffix):
    """Lightning's "ddp" default, DDP's broadcast_buffers=True: rank 0's running statistics
    reach rank 1 before each synced forward (with accumulation, every other one), so rank 1's
    statistics, its evaluation and the sync_dist-averaged val_loss are cpu ddp's."""
    got = assert_parity(torchrun_launch, f"cpu_bn_bcast{suffix}", f"mncore_bn_bcast{suffix}")
    per_rank = _results(torchrun_launch, "mncore_bn")
    running = [key for key in got[1]["state"] if key.endswith("running_mean")]
    assert running
    assert not torch.equal(got[1]["state"][running[0]], per_rank[1]["state"][running[0]])


def test_torchrun_launch_matches_cpu_ddp_with_manual_optimization(torchrun_launch):
    """manual_backward inside the traced step averages the gradients, as DDP's backward."""
    got = assert_parity(torchrun_launch, "cpu_manual", "mncore_manual")
    assert [g["compiled_calls_fit"] for g in got] == [24, 24]


def test_functional_collectives_trace_and_run_under_inductor(torchrun_launch):
    """The device layer needs no collective support of its own: torch's functional all-reduce
    traces into the aten graph and TorchInductor (O1) compiles it with gloo on CPU; 3 steps
    on 2 ranks match eager code that all-reduces with torch.distributed."""
    for got in _results(torchrun_launch, "collectives_o1"):
        assert "_c10d_functional.all_reduce" in got["graph"]
        _close(got["losses"], got["eager_losses"], "losses")
        for key, value in got["eager_state"].items():
            _close(got["state"][key], value, key)


def test_split_step_refuses_manual_optimization():
    """A manual step calls backward and step inside one graph: there is no point to split."""
    from tests.lightning.ddp_script import ManualClassifier

    trainer = _trainer(
        accelerator="mncore", strategy=MNCoreDDPStrategy(split_step=True), devices=1, max_steps=1
    )
    try:
        with pytest.raises(MisconfigurationException, match="split_step=False"):
            trainer.fit(ManualClassifier(), loader())
    finally:  # a one-process group was set up for the strategy
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_sync_batchnorm_is_refused_on_the_split_step():
    """The split step's graphs hold no collectives: SyncBatchNorm cannot exchange statistics."""
    from tests.lightning.lightning_testing import LitClassifier

    strategy = MNCoreDDPStrategy(split_step=True)
    trainer = _trainer(accelerator="mncore", strategy=strategy, devices=1, sync_batchnorm=True)
    try:
        with pytest.raises(
            MisconfigurationException, match=r"net\.1 is a SyncBatchNorm.*split_step"
        ):
            trainer.fit(LitClassifier(net="bn"), loader())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_sync_batchnorm_on_one_rank_is_batchnorm():
    """The user's own convert_sync_batchnorm, one rank (a process group of 1): training gives
    what BatchNorm gives under accelerator="cpu", strategy="ddp" (the same DistributedSampler
    order); the module stays a SyncBatchNorm."""
    from tests.lightning.lightning_testing import LitClassifier, LossCollector, trainer_kwargs

    def fit(accelerator: str, strategy: str, sync: bool) -> tuple[list[torch.Tensor], dict]:
        L.seed_everything(0, verbose=False)
        model = LitClassifier(net="bn")
        if sync:
            model.net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model.net)
        collector = LossCollector()
        trainer = L.Trainer(
            accelerator=accelerator,
            strategy=strategy,
            devices=1,
            callbacks=[collector],
            **trainer_kwargs(max_epochs=1),
        )
        trainer.fit(model, loader(n=48, shuffle=True))
        assert isinstance(model.net[1], torch.nn.SyncBatchNorm) is sync
        return collector.losses, model.state_dict()

    try:
        got_losses, got_state = fit("mncore", "mncore_ddp", sync=True)
        ref_losses, ref_state = fit("cpu", "ddp", sync=False)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    _close(got_losses, ref_losses, "losses")
    assert got_state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        _close(got_state[key], value, key)


def test_mlsdk_refuses_collectives_inside_the_graph(monkeypatch):
    from tests.fake_mlsdk import install as fake
    from tests.lightning.lightning_testing import LitClassifier

    with fake.installed(monkeypatch):
        strategy = MNCoreDDPStrategy(device="mncore2:auto", split_step=False)
        trainer = _trainer(accelerator="mncore", strategy=strategy, devices=1, max_steps=1)
        try:
            with pytest.raises(MisconfigurationException, match="split_step=True"):
                trainer.fit(LitClassifier(), loader())
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def test_slurm_task_is_a_rank_through_lightnings_environment(monkeypatch):
    """Under `srun` (a SLURM task per device), Lightning's SLURMEnvironment gives the ranks:
    this process is task 1 of 2 on one node, so local rank 1 and its own device."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for key, value in {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODELIST": "node1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "7",
    }.items():
        monkeypatch.setenv(key, value)
    # the strategy makes this process rank 1 for Lightning's rank-zero-only logging: undone after
    for flag in (fabric_rank_zero_only, utils_rank_zero_only):
        monkeypatch.setattr(flag, "rank", flag.rank)
    trainer = _trainer(accelerator="mncore", devices=2)
    strategy = trainer.strategy
    assert isinstance(strategy, MNCoreDDPStrategy)
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert strategy.cluster_environment.creates_processes_externally  # srun started the ranks
    assert (strategy.local_rank, strategy.global_rank, trainer.world_size) == (1, 1, 2)
    assert rank_device("mncore2:auto", strategy.local_rank) == "mncore2:1"
