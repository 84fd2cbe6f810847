"""Tensor-parallel decoding over two local processes (`mlx.launch --backend ring -n 2`).

One launch decodes a tiny checkpoint of every family (tests/helpers/distributed_child.py):
greedy tokens and forward counts equal a single process's, each rank holds about half
the parameter bytes, and sampled decodes agree across the ranks. The CLI and the
server run under mlx.launch too, and a rank killed mid-decode ends the other with an
error. Every launch is bounded by a subprocess timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.cli.convert import convert
from mlx_lm_diffusion.parallel.distributed import parameter_bytes
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_llada2_2, write_sdar
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
from mlx_lm_diffusion.testing.checkpoints import VOCAB, write_dream, write_llada
from mlx_lm_diffusion.testing.engine_runs import engine_decode
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma, write_nemotron
from model_adapters.runtime.sharding import check_divisible, quantization_groups

TESTS = Path(__file__).parents[1] / "helpers"  # (distributed_child.py, and what it imports)
ROOT = Path(__file__).parents[2]
LAUNCH = Path(sys.executable).with_name("mlx.launch")
LAUNCH_TIMEOUT = 420  # seconds: a launch that takes longer has hung (a loaded 2-core machine needs ~150)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def _ring_available() -> str:
    """'' if two ring processes can run here, else why not."""
    if not LAUNCH.exists():
        return f"mlx.launch not found next to {sys.executable}"
    if not mx.distributed.is_available():
        return "this MLX build has no distributed backend"
    return ""


pytestmark = pytest.mark.skipif(bool(_ring_available()), reason=_ring_available() or "ring available")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env.setdefault("MLX_LM_DIFFUSION_PEER_TIMEOUT", "60")
    return env


def launch(args: list, timeout: float = LAUNCH_TIMEOUT, **kwargs) -> subprocess.CompletedProcess:
    """Two ring processes on 127.0.0.1 running `args` (a script and its arguments)."""
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable, *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


# Decoding options per family: short canvases; DiffusionGemma's noise is seeded.
CASES = {
    "llada": dict(max_tokens=16, block_length=8),
    "llada_dual_cache": dict(max_tokens=16, block_length=8, cache="dual", threshold=0.5),
    "llada_8bit": dict(max_tokens=16, block_length=8),
    # a vocabulary of 289 rows: 145 on rank 0, 144 on rank 1 (the logit slices padded to gather)
    "llada_odd_vocabulary": dict(max_tokens=16, block_length=8),
    "llada_odd_vocabulary_8bit": dict(max_tokens=16, block_length=8),
    "dream": dict(max_tokens=16),
    "sdar": dict(max_tokens=8),
    "llada2": dict(max_tokens=16, threshold=0.5),
    "llada2_2": dict(max_tokens=16),  # block routing and the DELETE / SPLIT decoder
    "nemotron": dict(max_tokens=16, block_length=8, threshold=0.5),
    "diffusion_gemma": dict(max_tokens=16, seed=3),
    "ar_llama": dict(max_tokens=8),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dist")
    llada = write_llada(root / "llada")
    convert(str(llada), str(root / "llada_8bit"), quantize=True, q_bits=8, q_group_size=32)
    odd = write_llada(root / "llada_odd_vocabulary", vocab=VOCAB + 1)
    convert(str(odd), str(root / "llada_odd_vocabulary_8bit"), quantize=True, q_bits=8, q_group_size=32)
    return {
        "llada": llada,
        "llada_dual_cache": llada,
        "llada_8bit": root / "llada_8bit",
        "llada_odd_vocabulary": odd,
        "llada_odd_vocabulary_8bit": root / "llada_odd_vocabulary_8bit",
        "dream": write_dream(root / "dream"),
        "sdar": write_sdar(root / "sdar"),
        "llada2": write_llada2(root / "llada2"),
        "llada2_2": write_llada2_2(root / "llada2_2"),
        "nemotron": write_nemotron(root / "nemotron"),
        # two global KV heads: the full-attention layers split over two ranks
        "diffusion_gemma": write_diffusion_gemma(root / "gemma", num_global_key_value_heads=2),
        "ar_llama": write_causal(root / "ar_llama", "llama"),
    }


SAMPLED_OPTIONS = {"llada2_2": dict(edit_ops=())}  # (LLaDA2.2's edit decoding is greedy only)


def _cases(checkpoints: dict) -> list:
    return [
        {
            "name": name,
            "path": str(checkpoints[name]),
            "prompt": PROMPT,
            "options": options,
            "sampled_options": SAMPLED_OPTIONS.get(name, {}),
            "autoregressive": name.startswith("ar_"),
        }
        for name, options in CASES.items()
    ]


def _cli_args(checkpoints: dict, max_tokens: int) -> list:
    return [
        "--model",
        str(checkpoints["llada"]),
        "--prompt",
        "hello",
        "--max-tokens",
        str(max_tokens),
        "--block-length",
        "8",
        "--verbose",
        "False",
    ]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> dict:
    """One launch: both ranks' reports of every case, the CLI's output, and how rank 0
    ended once rank 1 was killed mid-decode (tests/helpers/distributed_child.py)."""
    out = tmp_path_factory.mktemp("ranks")
    job = out / "job.json"
    job.write_text(
        json.dumps(
            {
                "cases": _cases(checkpoints),
                "cli": _cli_args(checkpoints, 16),
                "die_cli": _cli_args(checkpoints, 400),
                "die_at_step": 5,
            }
        )
    )
    run = launch([str(TESTS / "distributed_child.py"), str(job), str(out)])
    ended = time.time()
    assert (out / "rank1.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return {
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)],
        "run": run,
        "killed_at": float((out / "killed_at").read_text()) if (out / "killed_at").exists() else None,
        "ended": ended,
    }


def _single_process(checkpoints: dict, name: str):
    model, tokenizer = mld.load(str(checkpoints[name]), autoregressive=name.startswith("ar_"))
    tokens, forwards = engine_decode(model, tokenizer, PROMPT, **CASES[name])
    return tokens, forwards, parameter_bytes(model, vision=False)  # (a vision tower stays whole)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_decode_as_one_process(checkpoints, two_ranks, name):
    tokens, forwards, full_bytes = _single_process(checkpoints, name)
    two_ranks = two_ranks["ranks"]
    for rank in two_ranks:
        assert rank[name]["tokens"] == tokens
        assert rank[name]["forwards"] == forwards
    assert two_ranks[0][name]["sampled"] == two_ranks[1][name]["sampled"]
    per_rank = [rank[name]["bytes"] for rank in two_ranks]
    # (equal; with an odd vocabulary rank 0 holds one more row of the embedding and of the head)
    assert per_rank[0] == per_rank[1] or "odd" in name and 0 < per_rank[0] - per_rank[1] <= 0.01 * full_bytes
    # half, plus what stays replicated (norms, routers; mlx-lm keeps an AR model's
    # embeddings and head whole)
    limit = 0.75 if name.startswith("ar_") else 0.56
    assert 0.45 * full_bytes <= per_rank[0] <= limit * full_bytes, (per_rank, full_bytes)


def test_the_cli_under_mlx_launch_prints_what_one_process_prints(checkpoints, two_ranks, capsys):
    from mlx_lm_diffusion.cli.generate import main

    assert main(_cli_args(checkpoints, 16)) == 0
    single = capsys.readouterr().out
    assert single.strip()
    # rank 0 printed it, once; the other rank printed nothing
    assert two_ranks["run"].stdout == single


def test_the_readme_launch_of_the_console_script_answers_once():
    """The README's form: the command after `--` is the console script (on PATH), no --python."""
    env = _env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    assert Path(sys.executable).with_name("mlx_lm_diffusion.generate").exists()  # (pip install's console script)
    run = subprocess.run(
        [
            str(LAUNCH),
            "--backend",
            "ring",
            "-n",
            "2",
            "--",
            "mlx_lm_diffusion.generate",
            "--prompt",
            "357+468=",
            "--verbose",
            "False",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["825"]  # (rank 0 prints; the demo model, as without mlx.launch)


def test_a_rank_killed_mid_decode_ends_the_other_with_an_error(two_ranks):
    run = two_ranks["run"]
    assert two_ranks["killed_at"] is not None, run.stderr[-3000:]
    # (the heartbeat's word, or the collective's failure when that comes first)
    assert (
        "error: rank 0/2: rank 1 is gone" in run.stderr or "error: rank 0/2: the distributed group failed" in run.stderr
    ), run.stderr[-3000:]
    assert "rank 0 exited with code 1" in run.stderr  # (mlx.launch's report; SIGTERM was ignored)
    assert two_ranks["ended"] - two_ranks["killed_at"] < 60


def test_sizes_that_do_not_divide_are_refused_before_anything_moves(checkpoints):
    model, _ = mld.load(str(checkpoints["llada"]))
    before = parameter_bytes(model)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by 3"):
        model.shard(_Ranks(3))
    assert parameter_bytes(model) == before and getattr(model, "shard_group", None) is None
    with pytest.raises(ValueError, match="the vocabulary size \\(289\\) is not divisible by 2"):
        check_divisible([("the vocabulary size", 289)], 2)


class _Ranks:
    """A stand-in group: the size checks read only its size."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return 0


def test_quantization_groups_must_divide_too(checkpoints):
    model, _ = mld.load(str(checkpoints["llada_8bit"]))  # hidden 64 in groups of 32: 2 a row
    groups = quantization_groups(model)
    assert groups and all(n == 2 or n == 4 for _, n in groups)  # (the MLP's down_proj: 128 inputs)
    with pytest.raises(ValueError, match="quantization groups per row of model.embed_tokens \\(2\\)"):
        check_divisible(groups, 4)


def test_moe_and_gemma_sizes_are_checked_too(checkpoints, tmp_path):
    llada2, _ = mld.load(str(checkpoints["llada2"]))
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by 3"):
        llada2.shard(_Ranks(3))
    with pytest.raises(ValueError, match="moe_intermediate_size \\(32\\) is not divisible by 64"):
        check_divisible(llada2.shard_sizes()[3:], 64)
    # the released layout's one global KV head cannot split over two ranks
    gemma, _ = mld.load(str(write_diffusion_gemma(tmp_path / "gemma")))
    with pytest.raises(ValueError, match="num_global_key_value_heads \\(1\\) is not divisible by 2"):
        gemma.shard(_Ranks(2))


def _ranks_of(launcher: subprocess.Popen) -> dict:
    """{rank: pid} of the processes mlx.launch started (its children, by MLX_RANK)."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher.pid:
                continue
            env = dict(e.split("=", 1) for e in (proc / "environ").read_bytes().decode().split("\0") if "=" in e)
        except (OSError, ValueError, IndexError):
            continue
        if "MLX_RANK" in env:
            ranks[int(env["MLX_RANK"])] = int(proc.name)
    return ranks


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc")
def test_the_server_under_mlx_launch_answers_cancels_and_stops(checkpoints, tmp_path):
    from openai import OpenAI
    from server_runs import free_port

    port = free_port()
    env = dict(_env(), HF_HUB_CACHE=str(tmp_path / "hub"))
    (tmp_path / "hub").mkdir()
    log = open(tmp_path / "server.log", "w")
    launcher = subprocess.Popen(
        [
            str(LAUNCH),
            "--backend",
            "ring",
            "-n",
            "2",
            "--python",
            sys.executable,
            "--",
            "-m",
            "mlx_lm_diffusion.server",
            "--model",
            str(checkpoints["llada"]),
            "--port",
            str(port),
            "--block-length",
            "8",
        ],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while True:
            assert launcher.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                client.models.list()
                break
            except Exception:
                time.sleep(1)
        model, tokenizer = mld.load(str(checkpoints["llada"]))
        expected = mld.generate(model, tokenizer, "hello", max_tokens=16, block_length=8)
        answer = client.completions.create(model="default_model", prompt="hello", max_tokens=16)
        assert answer.choices[0].text == expected

        # a long stream abandoned after two chunks: every rank stops it at the same forward
        stream = client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=400, stream=True
        )
        for i, _ in enumerate(stream):
            if i == 1:
                break
        stream.close()
        again = client.completions.create(model="default_model", prompt="hello", max_tokens=16)
        assert again.choices[0].text == expected  # the ranks still decode in step
        assert "rank 1/2: rank 0 stopped this decode" in (tmp_path / "server.log").read_text()

        ranks = _ranks_of(launcher)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[0], signal.SIGTERM)  # rank 0's stop reaches rank 1: both end, cleanly
        launcher.wait(timeout=60)
        text = (tmp_path / "server.log").read_text()
        assert "exited with code" not in text and "Traceback" not in text, text[-3000:]
    finally:
        if launcher.poll() is None:
            for pid in _ranks_of(launcher).values():
                os.kill(pid, signal.SIGKILL)
            launcher.kill()
            launcher.wait(timeout=30)
        log.close()


def test_the_peer_watchdog_ends_a_rank_that_waits_too_long():
    """A peer that hangs without closing its connections: the watchdog ends this rank
    (exit 1, one line) once no progress came for its timeout; petting it keeps it quiet."""
    script = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("dist", {str(ROOT / "mlx_lm_diffusion" / "parallel" / "distributed.py")!r})
dist = importlib.util.module_from_spec(spec); spec.loader.exec_module(dist)
class Group:
    def rank(self): return 1
    def size(self): return 2
watchdog = dist.PeerWatchdog(Group(), timeout=1.0)
watchdog.arm()
for _ in range(30):  # progress every 0.1 s for 3 s: no exit
    time.sleep(0.1); watchdog.pet()
print("petted", flush=True)
time.sleep(30)  # no progress: the watchdog ends the process after ~1 s
print("not reached", flush=True)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout == "petted\n"
    assert "error: rank 1/2: no progress from the other ranks for 1 s" in run.stderr


def test_a_group_that_cannot_form_ends_each_rank_with_one_line(tmp_path):
    """A rank whose peer cannot be reached (the ring backend's "[ring] Couldn't connect",
    after ~30 s) died with a traceback; the generate CLI now says in one line that the group
    could not form, naming the rank, and exits 1 (mlx.launch's own exit status stays MLX's)."""
    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    with socket.socket() as a, socket.socket() as b:  # two free ports, nothing listening on them after
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = a.getsockname()[1], b.getsockname()[1]
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{ports[0]}"], [f"127.0.0.1:{ports[1]}"]]))
    env = {**os.environ, "MLX_HOSTFILE": str(hosts), "MLX_RANK": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mlx_lm_diffusion.generate", "--model", str(DEMO_MODEL_PATH), "--prompt", "1+1="],
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith("error: rank 1: the distributed group could not form: [ring] Couldn't connect")
    )
