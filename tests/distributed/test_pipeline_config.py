"""Hostfiles, layer splits and the architecture check of a pipeline (no ranks started)."""

from __future__ import annotations

import json

import pytest

from moed.daemon.distributed.hostfile import Backend, HostfileError, load_hostfile, parse_hostfile
from moed.daemon.distributed.launch import remote_script
from moed.daemon.distributed.protocol import Step, StepOp, decode_header
from moed.daemon.distributed.rank0 import check_supported
from moed.daemon.distributed.rank_model import PipelineUnsupported
from moed.daemon.distributed.split import SplitError, balanced_split, layer_costs, parse_split
from moed.daemon.experts import CheckpointIndex
from moed.protocol.model_config import ModelConfig


def test_mlx_launch_hostfile_with_moed_extras(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(
        json.dumps(
            {
                "backend": "ring",
                "envs": ["MLX_METAL_FAST_SYNCH=1"],
                "hosts": [
                    {"ssh": "mini1", "ips": ["10.0.0.1"], "expert_budget": "6GB", "layers": 22},
                    {"ssh": "mini2", "ips": ["10.0.0.2"], "expert_budget": "40%", "layers": 18},
                ],
            }
        )
    )
    group = load_hostfile(path, port=40000)
    assert group.backend is Backend.RING and group.size == 2
    assert group.given_split == (22, 18)
    assert [h.expert_budget for h in group.hosts] == ["6GB", "40%"]
    # Rank 0's guard listens on host 0's address; the ring's ports are told only to the ranks
    # that pass it, never written into a rank's command line or environment.
    assert group.guard_address == ("10.0.0.1", 40000)
    script = remote_script(group, 1, ["moed", "rank", "--spec", "{}"])
    assert "export MLX_RANK=1;" in script and "MLX_HOSTFILE" not in script
    assert "export MLX_METAL_FAST_SYNCH=1;" in script


def test_plain_list_hostfile_and_bad_ones():
    group = parse_hostfile([{"ssh": "a", "ips": ["1.2.3.4"]}, {"ssh": "b", "ips": ["1.2.3.5"]}])
    assert group.given_split is None and not group.hosts[0].is_local
    with pytest.raises(HostfileError, match="at least 2 hosts"):
        parse_hostfile([{"ssh": "a", "ips": ["1.2.3.4"]}])
    with pytest.raises(HostfileError, match="needs `ips`"):
        parse_hostfile([{"ssh": "a"}, {"ssh": "b"}])
    with pytest.raises(HostfileError, match="not for"):
        parse_hostfile([{"ssh": "a", "ips": ["x"], "layers": 2}, {"ssh": "b", "ips": ["y"]}])
    with pytest.raises(HostfileError, match="backend"):
        parse_hostfile({"backend": "carrier-pigeon", "hosts": [{"ssh": "a"}, {"ssh": "b"}]})


def test_splits():
    assert parse_split("3,1", 2, 4) == (3, 1)
    with pytest.raises(SplitError):
        parse_split("3,2", 2, 4)
    with pytest.raises(SplitError):
        parse_split("abc", 2, 4)
    # The expensive last layers go to rank 0 alone; the cheap first three to rank 1.
    assert balanced_split([1.0, 1.0, 1.0, 3.0], 2) == (1, 3)
    assert balanced_split([1.0] * 6, 3) == (2, 2, 2)


def test_layer_costs_from_the_checkpoint(checkpoint_factory):
    path = checkpoint_factory("deepseek_v3", num_layers=4)
    costs = layer_costs(CheckpointIndex(path), 4, top_k=2)
    assert costs[0].num_experts == 0  # deepseek's first layer is dense
    assert all(c.num_experts == 8 and c.expert_bytes > 0 for c in costs[1:])


def test_step_header_round_trip():
    import numpy as np

    from moed.daemon.distributed.protocol import with_body

    # A decode step: the batch's cache ops and its B tokens ride in the header.
    ops = (4, 9, 2, 0, 2)  # FILTER list 9 to rows 0 and 2
    decode = Step(StepOp.FORWARD, 3, (5,), ops, np.array([[4], [8], [15]], dtype=np.int32))
    header, payload = decode.encode()
    step, follow = decode_header(header)
    assert payload is None and follow == 0
    assert (step.op, step.seq, step.handles, step.ops) == (StepOp.FORWARD, 3, (5,), ops)
    assert step.tokens.tolist() == [[4], [8], [15]]
    # A prefill chunk: ops then tokens follow the header in one more collective.
    prefill = Step(StepOp.FORWARD, 4, (5,), ops, np.arange(600, dtype=np.int32).reshape(2, 300))
    header, payload = prefill.encode()
    step, follow = decode_header(header)
    assert follow == 605 and payload.tolist() == [*ops, *range(600)]
    step = with_body(step, payload, len(step.ops), step.tokens.shape)
    assert step.ops == ops and step.tokens.tolist() == prefill.tokens.tolist()
    # Ops alone (a status step after rows left) need no tokens.
    header, payload = Step(StepOp.STATUS, 5, (), (1, 7)).encode()
    step, follow = decode_header(header)
    assert (step.op, step.ops, step.tokens, follow) == (StepOp.STATUS, (1, 7), None, 0)


def test_architecture_without_pipeline_support_is_refused(checkpoint_factory):
    check_supported(checkpoint_factory("qwen3_moe"))
    check_supported(checkpoint_factory("qwen3_5_moe"))  # PipelineMixin one module down
    with pytest.raises(PipelineUnsupported, match="'mixtral' has no pipeline support.*qwen3_moe"):
        check_supported(checkpoint_factory("mixtral"))


def test_service_install_runs_the_group(tmp_path):
    from click.testing import CliRunner

    from moed.daemon.cli import main
    from moed.daemon.ground.exit_codes import DaemonExit

    args = ["service", "install", "--dry-run", "--platform", "linux", "--pipeline", "2"]
    result = CliRunner().invoke(main, [*args, "--config", str(tmp_path / "moed.toml")])
    assert result.exit_code == 0, result.output
    assert "pipeline = 2" in result.output  # the unit runs rank 0, which starts the others
    prevent = next(
        line for line in result.output.splitlines() if "RestartPreventExitStatus" in line
    )
    assert str(int(DaemonExit.RANK_FAILED)) not in prevent.split("=", 1)[1].split()


def test_rank_spec_from_a_hostfile_and_the_cost_split(checkpoint_factory, tmp_path):
    from moed.daemon.config import ServeConfig
    from moed.daemon.distributed.rank_model import resolve_split
    from moed.daemon.distributed.spec import RankSpec, group_spec, rank_spec
    from moed.daemon.distributed.split import SplitMode

    path = checkpoint_factory("deepseek_v3", num_layers=4)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(
        json.dumps(
            [
                {"ssh": "localhost", "ips": ["127.0.0.1"]},
                {"ssh": "mini2", "ips": ["10.0.0.2"], "expert_budget": "2GB"},
            ]
        )
    )
    serve = ServeConfig(hostfile=str(hosts), cache_budget="25%", prefix_cache_bytes="1GB")
    config = ModelConfig.read(path)
    spec = RankSpec.from_json(rank_spec(serve, group_spec(serve), path, config).to_json())
    assert spec.budgets == ["25%", "2GB"]  # a host's own budget wins over the daemon's
    # The prefix cache's memory tier of the whole group; each rank plans for its layers' share.
    assert spec.prefix_cache_bytes == 10**9 and spec.streaming(1).prefix_cache_bytes == 10**9
    assert spec.control == [False, True]  # only the other host binds its own moed socket
    assert spec.split_for(2, 4) is SplitMode.EVEN
    # The cost split's slowest stage is never slower than the even split's.
    costs = [c.per_token_bytes for c in layer_costs(CheckpointIndex(path), 4, top_k=2)]

    def slowest(split):  # rank 0 runs the last layers
        bounds = [sum(split[r + 1 :]) for r in range(len(split))]
        return max(sum(costs[b : b + n]) for b, n in zip(bounds, split))

    cost_split = resolve_split(SplitMode.COST, 2, path, config, 4)
    assert sum(cost_split) == 4
    assert slowest(cost_split) <= slowest(resolve_split(SplitMode.EVEN, 2, path, config, 4))


@pytest.mark.process
@pytest.mark.parametrize(
    "script,code",
    [
        ("import sys; sys.exit(6)", 6),  # a rank whose memory plan refused: final, no restart loop
        ("import sys; sys.exit(1)", 7),  # any other death: restart the group
        ("import time; print('.', flush=True); time.sleep(30)", 7),  # beats once, then freezes
    ],
    ids=["does-not-fit", "died", "stalled"],
)
def test_rank_monitor_tells_a_final_exit_from_a_restart(script, code):
    import subprocess
    import sys
    import time

    from moed.daemon.distributed.hostfile import RankHost
    from moed.daemon.distributed.launch import RankProcess

    popen = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    rank = RankProcess(1, RankHost(1, "127.0.0.1", ("127.0.0.1",)), popen)
    try:
        deadline = time.monotonic() + 20
        while (failure := rank.failure(timeout_s=0.5)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failure is not None and failure.exit_code == code, failure
    finally:
        rank.stop(grace_s=1)


def test_beats_that_waited_while_rank_0_did_not_run_are_not_silence():
    # Rank 0 busy elsewhere (its ring init keeps the GIL, a starved CPU) for longer than the
    # timeout: the beats wait in the pipe and count; a rank that then freezes is still seen.
    import subprocess
    import sys
    import time

    from moed.daemon.distributed.hostfile import RankHost
    from moed.daemon.distributed.launch import RankProcess

    script = (
        "import os, signal, time\n"
        "for _ in range(30):\n"
        "    print('.', flush=True); time.sleep(0.05)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
    )
    popen = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    rank = RankProcess(1, RankHost(1, "127.0.0.1", ("127.0.0.1",)), popen)
    try:
        time.sleep(1.0)  # the monitor does not run: twice the timeout
        assert rank.failure(timeout_s=0.5) is None
        deadline = time.monotonic() + 20
        while (failure := rank.failure(timeout_s=0.5)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failure is not None and "stopped responding" in failure.reason, failure
    finally:
        popen.kill()
        popen.wait()


def test_a_rank_frozen_before_its_first_beat_after_init_is_seen_once_the_group_formed():
    # CI: the follower froze (SIGSTOP) right after the ring formed, before any beat after its
    # `wait` reached rank 0: "still starting" let only its exit count, and the request stalled.
    import subprocess
    import sys
    import time

    from moed.daemon.distributed.hostfile import RankHost
    from moed.daemon.distributed.launch import RankProcess

    script = "import os, signal\nprint('wait', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    popen = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    rank = RankProcess(1, RankHost(1, "127.0.0.1", ("127.0.0.1",)), popen)
    try:
        deadline = time.monotonic() + 20
        while rank.failure(timeout_s=0.5) is None and time.monotonic() < deadline:
            if rank.formed_at is None and time.monotonic() > deadline - 15:
                rank.group_formed(time.monotonic())  # rank 0's init returned
            time.sleep(0.05)
        failure = rank.failure(timeout_s=0.5)
        assert failure is not None and "stopped responding" in failure.reason, failure
    finally:
        popen.kill()
        popen.wait()
