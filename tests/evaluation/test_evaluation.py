"""mlx_lm_diffusion.evaluate: lm-evaluation-harness over the diffusion families.

The likelihood bound equals an independent numpy computation over the masks and times
it drew (LLaDA's full canvas, Dream's shift, SDAR's blocks), its standard error falls as
1/sqrt(samples), a seed repeats a score; the CLI runs a local YAML task on the demo and
matches the demo's own evaluation (and a sweep gives one row per setting with its
tokens per forward); a multiple-choice task is answered by the bound; bad input is one
line and exit 2. Offline: the tasks and their data are written into tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion
from mlx_lm_diffusion.evaluation import tasks as task_index
from mlx_lm_diffusion.evaluation.command import main
from mlx_lm_diffusion.evaluation.layout import bound_layout
from mlx_lm_diffusion.evaluation.likelihood import estimate_log_likelihood, greedy_match
from mlx_lm_diffusion.evaluation.noise import stratified_masks
from mlx_lm_diffusion.evaluation.sweep import parse_axes, settings
from mlx_lm_diffusion.testing.checkpoints import write_llada
from model_adapters import adapter_for

CONTEXT, CONTINUATION = "hello there", " general kenobi, you are a bold one"


# ----------------------------------------------------------------------------- the bound


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def numpy_estimate(
    model, tokens: np.ndarray, mask_id: int, blocks, draws, shift: int = 0, causal_prefix: bool = False
) -> float:
    """The bound from its definition: per sample and block, the canvas up to the block's end
    (clean before it, masked where drawn), the model's raw logits with its own attention
    (full; block-causal for SDAR and LLaDA2; for Nemotron, `causal_prefix`: causal before
    the block, the block over everything up to its end), token i read from row i - shift,
    cross-entropy on the masked positions over the time; minus the mean over samples of
    the sum over blocks."""
    losses = []
    for batch in draws:
        loss = np.zeros(batch[0].masks.shape[0])
        for (start, end), draw in zip(blocks, batch):
            canvas = np.tile(tokens[:end], (len(loss), 1))
            canvas[:, start:end][draw.masks] = mask_id
            query, key = np.arange(end)[:, None], np.arange(end)[None, :]
            mask = mx.array(np.where(query < start, key <= query, True)) if causal_prefix else None
            logits = np.array(model(mx.array(canvas), mask=mask).astype(mx.float32))
            lp = log_softmax(logits[:, start - shift : end - shift])
            picked = np.take_along_axis(lp, np.tile(tokens[start:end], (len(loss), 1))[..., None], axis=-1)[..., 0]
            loss += -(picked * draw.masks).sum(axis=1) / draw.times
        losses.append(loss)
    return -float(np.concatenate(losses).mean())


def expected_blocks(family: str, P: int, T: int) -> list:
    """Where each family's bound puts its blocks: the continuation at once (LLaDA, Dream),
    attention blocks on absolute positions, the first shared with the context (SDAR: 4,
    LLaDA2: 32), blocks of 32 from the context's end (Nemotron)."""
    if family in ("llada", "dream"):
        return [(P, T)]
    if family == "nemotron":
        return [(s, min(s + 32, T)) for s in range(P, T, 32)]
    size = {"sdar": 4, "llada2_2": 8}.get(family, 32)  # (the 2.2 test checkpoint's block_size is 8)
    return [(max(s, P), min(s + size, T)) for s in range(P // size * size, T, size)]


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "llada2_2", "nemotron"])
def test_the_bound_is_the_numpy_computation_over_the_same_masks(family, request):
    model, tokenizer = request.getfixturevalue(family)
    adapter = adapter_for(model, tokenizer)
    context, continuation = tokenizer.encode(CONTEXT), tokenizer.encode(CONTINUATION)
    tokens = np.array(context + continuation)
    estimate = estimate_log_likelihood(adapter, context, continuation, samples=12, batch_size=8, seed=3)
    assert estimate.blocks == expected_blocks(family, len(context), len(tokens))
    assert len(estimate.blocks) > 1 or family in ("llada", "dream")
    assert [batch[0].samples for batch in estimate.draws] == [8, 4]
    assert estimate.forwards == 2 * len(estimate.blocks)
    expected = numpy_estimate(
        model,
        tokens,
        adapter.mask_id,
        estimate.blocks,
        estimate.draws,
        shift=1 if family == "dream" else 0,
        causal_prefix=family == "nemotron",
    )
    assert estimate.log_likelihood == pytest.approx(expected, rel=1e-5)
    # given back, the draws give the same estimate
    again = estimate_log_likelihood(adapter, context, continuation, draws=estimate.draws)
    assert again.log_likelihood == estimate.log_likelihood


def test_the_draws_are_llada_stratified_counts():
    rng = np.random.default_rng(0)
    for length, batch in ((5, 8), (16, 4), (1, 3), (7, 7)):
        draw = stratified_masks(rng, length, batch)
        counts = draw.masks.sum(axis=1)
        assert np.array_equal(draw.times, counts / length)
        # x_i = round(linspace(k, k + (b - 1) L / b, b)), wrapped into 1..L, for some k in 1..L
        candidates = [
            (np.round(np.linspace(k, k + (batch - 1) * length / batch, batch)).astype(int) - 1) % length + 1
            for k in range(1, length + 1)
        ]
        assert any(np.array_equal(counts, c) for c in candidates)


def test_the_standard_error_falls_as_one_over_root_samples(llada):
    adapter = adapter_for(*llada)
    context, continuation = llada[1].encode(CONTEXT), llada[1].encode(CONTINUATION)

    def runs(samples):
        return [
            estimate_log_likelihood(adapter, context, continuation, samples=samples, batch_size=16, seed=s)
            for s in range(6)
        ]

    few, many = runs(64), runs(256)
    ratio = np.mean([e.standard_error for e in many]) / np.mean([e.standard_error for e in few])
    assert 0.4 < ratio < 0.62, ratio  # 4x samples: half the error
    # the reported error does not understate how much the estimate moves from seed to seed
    spread = np.std([e.log_likelihood for e in many], ddof=1)
    assert spread < 1.5 * np.mean([e.standard_error for e in many])


def instance(kind: str, args: tuple, task: str = "t"):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0, metadata=(task, 0, 1))


def test_the_same_seed_gives_the_same_score(llada):
    from mlx_lm_diffusion.evaluation.harness import DiffusionLM

    def lm(seed):
        return DiffusionLM(loaded=llada, mc_samples=16, batch_size=8, seed=seed, use_chat_template=False)

    requests = [instance("loglikelihood", (CONTEXT, CONTINUATION)), instance("loglikelihood", ("a", " b"))]
    first = lm(1).loglikelihood(requests)
    assert lm(1).loglikelihood(requests[::-1]) == first[::-1]  # any order, any company
    assert lm(1).loglikelihood(requests[:1]) == first[:1]
    assert lm(2).loglikelihood(requests)[0][0] != first[0][0]
    assert all(np.isfinite(score) and score < 0 and isinstance(greedy, bool) for score, greedy in first)


def test_is_greedy_holds_for_the_argmax_continuation(llada):
    model, tokenizer = llada
    adapter = adapter_for(model, tokenizer)
    context = tokenizer.encode(CONTEXT)
    canvas = np.array(context + [adapter.mask_id])
    logits = np.array(model(mx.array(canvas[None]))[0, -1])
    logits[adapter.mask_id] = -np.inf
    best = int(logits.argmax())
    assert greedy_match(adapter, context, [best])[0]
    assert not greedy_match(adapter, context, [(best + 1) % 256])[0]


@pytest.fixture(scope="module")
def short_llada(tmp_path_factory):
    return mlx_lm_diffusion.load(str(write_llada(tmp_path_factory.mktemp("short"), max_len=24)))


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma

    return write_diffusion_gemma(tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="module")
def gemma(gemma_path):  # (conftest's writes its own checkpoint: one is enough here)
    return mlx_lm_diffusion.load(str(gemma_path))


def test_rolling_scores_a_text_in_windows_of_the_context(short_llada):
    from mlx_lm_diffusion.evaluation.harness import DiffusionLM, request_seed

    model, tokenizer = short_llada
    lm = DiffusionLM(loaded=short_llada, mc_samples=8, batch_size=8, use_chat_template=False)
    adapter = adapter_for(model, tokenizer)
    short, long = "tiny text", "a text longer than the twenty-four positions of this model"
    ids = tokenizer.encode(short, add_special_tokens=False)
    alone = estimate_log_likelihood(adapter, [], ids, 8, 8, request_seed(lm.seed, [], ids))
    scores = lm.loglikelihood_rolling(
        [instance("loglikelihood_rolling", (short,)), instance("loglikelihood_rolling", (long,))]
    )
    assert scores[0] == alone.log_likelihood  # one window, on nothing at all
    assert np.isfinite(scores[1]) and scores[1] < scores[0]
    assert lm.speed.task("t").scoring_forwards == 1 + 3  # 59 tokens: windows of 23, 23 and 13


def test_a_uniform_noise_family_has_no_bound(gemma):
    with pytest.raises(ValueError, match="no likelihood bound for a uniform-noise canvas"):
        bound_layout(adapter_for(*gemma))


# ----------------------------------------------------------------------------- the demo through the CLI

ADDITION = """task: demo_addition
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

CHOICE = """task: demo_addition_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

N_PROBLEMS = 40


def five_digit_choices(pairs, rng) -> list:
    """Per problem the right sum and three wrong five-digit sums, each differing from it in
    one or two of its last four digits (the demo writes five-digit sums with no filler)."""
    docs = []
    for a, b in pairs:
        right = str(a + b)
        wrong: set = set()
        while len(wrong) < 3:
            digits = list(right)
            for i in rng.choice(np.arange(1, 5), size=rng.integers(1, 3), replace=False):
                digits[i] = str((int(digits[i]) + rng.integers(1, 10)) % 10)
            wrong.add("".join(digits))
        choices = sorted(wrong | {right})
        docs.append({"question": f"{a}+{b}=", "choices": choices, "label": choices.index(right)})
    return docs


def five_digit_sums(rng, n) -> list:
    """`n` held-out pairs of four-digit operands whose sum has five digits."""
    from mlx_lm_diffusion.demo import is_held_out

    a, b = rng.integers(1000, 10000, size=(2, 40 * n))
    keep = (a + b >= 10**4) & is_held_out(a, b)
    pairs = list(dict.fromkeys(zip(a[keep].tolist(), b[keep].tolist())))
    assert len(pairs) >= n
    return pairs[:n]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from mlx_lm_diffusion.demo.problems import held_out_problems

    root = tmp_path_factory.mktemp("tasks")
    cache = root / "hf-datasets"
    addition = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in held_out_problems(N_PROBLEMS)]
    five = five_digit_sums(np.random.default_rng(77), N_PROBLEMS)
    for name, docs, template in (
        ("addition", addition, ADDITION),
        ("choice", five_digit_choices(five, np.random.default_rng(0)), CHOICE),
    ):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"demo_{name}.yaml").write_text(template.format(data=data, cache=cache))
    return root


@pytest.fixture(scope="module")
def demo():
    from mlx_lm_diffusion.demo import load_demo

    return load_demo()


def run_cli(capsys, *argv) -> tuple:
    try:
        code = main(list(argv))
    except SystemExit as e:  # (argparse's own errors)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(text: str) -> list:
    lines = [line for line in text.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_cli_matches_the_demo_evaluation_and_sweeps(demo, task_dir, tmp_path, capsys):
    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
    from mlx_lm_diffusion.demo.evaluate import evaluate
    from mlx_lm_diffusion.demo.problems import held_out_problems

    out_dir = tmp_path / "out"
    code, out, err = run_cli(
        capsys,
        "--model",
        str(DEMO_MODEL_PATH),
        "--tasks",
        "demo_addition",
        "--include-path",
        str(task_dir),
        "--output-dir",
        str(out_dir),
        "--batch-size",
        "16",
        "--sweep",
        "threshold=0.5,0.9",
    )
    assert code == 0, err
    rows = table_rows(out)
    assert [r[:3] for r in rows] == [
        ["threshold=0.5", "demo_addition", "exact_match"],
        ["threshold=0.9", "demo_addition", "exact_match"],
    ]
    assert table_rows((out_dir / "evaluation.md").read_text()) == rows
    pairs = held_out_problems(N_PROBLEMS)
    for row, threshold in zip(rows, (0.5, 0.9)):
        reference = evaluate(*demo, pairs, max_tokens=8, threshold=threshold)
        assert float(row[3].split()[0]) == pytest.approx(reference.accuracy, abs=1e-4)
        assert float(row[4]) == pytest.approx(reference.tokens_per_forward, abs=0.005)  # tokens per forward
        assert int(row[6]) == sum(reference.forwards)
        record = json.loads(next(out_dir.glob(f"*threshold={threshold}.json")).read_text())
        assert record["setting"] == f"threshold={threshold}"
        assert record["results"]["demo_addition"]["exact_match,none"] == pytest.approx(reference.accuracy)
        assert record["speed"]["demo_addition"]["tokens_per_forward"] == pytest.approx(reference.tokens_per_forward)
    # the plot of the metric against tokens per forward and tok/s: a real, non-blank picture
    import matplotlib.image

    picture = matplotlib.image.imread(out_dir / "evaluation.png")
    assert picture.shape[0] > 100 and picture.shape[1] > 200 and picture[..., :3].std() > 0.05
    if os.environ.get("STUDIO_PICTURES"):  # (the docs' picture, made by this test)
        shutil.copy(out_dir / "evaluation.png", Path(os.environ["STUDIO_PICTURES"]) / "evaluation.png")


def test_multiple_choice_by_the_bound_finds_the_sum(task_dir, tmp_path, capsys):
    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    code, out, err = run_cli(
        capsys,
        "--model",
        str(DEMO_MODEL_PATH),
        "--tasks",
        "demo_addition_choice",
        "--include-path",
        str(task_dir),
        "--output-dir",
        str(tmp_path),
        "--mc-samples",
        "16",
        "--batch-size",
        "16",
    )
    assert code == 0, err
    (row,) = table_rows(out)
    assert row[:3] == ["defaults", "demo_addition_choice", "acc"]
    assert float(row[3].split()[0]) >= 0.95
    assert row[4] == row[5] == "-"  # no generation: no tokens per forward
    assert int(row[6]) == N_PROBLEMS * 4 * 2  # per choice: one batch of samples, one is_greedy forward


# ----------------------------------------------------------------------------- bad input


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep", "threshold"], "--sweep takes name=value"),
        (["--sweep", "threshold=0.5,"], "is not a number"),
        (["--sweep", "temperature=0.5"], "unknown decoding option 'temperature'"),
        (["--sweep", "threshold=1.5"], "threshold must be a number in [0, 1]"),
        (["--sweep", "threshold=0.5", "threshold=0.9"], "names 'threshold' twice"),
        (["--threshold", "0.5", "--sweep", "threshold=0.9"], "--threshold is given as a flag and as a --sweep axis"),
        (["--mc-samples", "0"], "--mc-samples must be at least 1"),
        (["--batch-size", "x"], "invalid int value"),
        (["--chat-template-args", "[1]"], "must be a JSON object"),
        (["--strategy", "nope"], "strategy must be one of"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    code, _, err = run_cli(capsys, "--tasks", "anything", *argv)
    assert code == 2
    assert message in one_error_line(err)


def test_an_unknown_task_is_refused_before_loading(task_dir, capsys, monkeypatch):
    monkeypatch.setattr(task_index, "BUILTIN_TASKS", False)  # (indexing lm-eval's 15k task files takes ~10 s)
    code, _, err = run_cli(
        capsys, "--model", "/nonexistent", "--tasks", "demo_addition", "no_such_task", "--include-path", str(task_dir)
    )
    assert code == 2
    assert "unknown task 'no_such_task'" in one_error_line(err)
    code, _, err = run_cli(capsys, "--tasks", "demo_addition", "--include-path", str(task_dir / "nope"))
    assert code == 2 and "no such directory" in one_error_line(err)


def test_a_family_without_a_bound_is_refused(gemma_path, task_dir, tmp_path, capsys):
    code, _, err = run_cli(
        capsys,
        "--model",
        str(gemma_path),
        "--tasks",
        "demo_addition_choice",
        "--limit",
        "1",
        "--include-path",
        str(task_dir),
        "--output-dir",
        str(tmp_path),
    )
    assert code == 2
    assert "no likelihood bound for a uniform-noise canvas" in err.strip().splitlines()[-1]


def test_without_lm_eval_the_cli_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # (import lm_eval: ImportError)
    code, _, err = run_cli(capsys, "--tasks", "anything")
    assert code == 2
    assert 'pip install -e ".[eval]"' in one_error_line(err)


def test_sweep_settings_are_the_cartesian_product():
    axes = parse_axes(["threshold=0.7,0.9", "cache=none,dual", "block_length=4"])
    assert settings(axes) == [
        {"threshold": 0.7, "cache": None, "block_length": 4},
        {"threshold": 0.7, "cache": "dual", "block_length": 4},
        {"threshold": 0.9, "cache": None, "block_length": 4},
        {"threshold": 0.9, "cache": "dual", "block_length": 4},
    ]
    assert settings([]) == [{}]


def test_generate_until_stops_limits_and_applies_the_chat_template(demo, llada):
    """lm-eval's generate_until arguments as the harness sends them: `until` cuts the answer
    at a stop string (a row leaves the batch there), `max_gen_toks` bounds it; a chat
    template renders the request as the tokenizer does (mlx_lm.evaluate's convention)."""
    from mlx_lm_diffusion.evaluation.harness import DiffusionLM

    lm = DiffusionLM(loaded=demo, use_chat_template=False)
    answers = lm.generate_until(
        [
            instance("generate_until", ("357+468=", {"until": ["2"], "max_gen_toks": 8})),
            instance("generate_until", ("357+468=", {"until": "x", "max_gen_toks": 8})),
            instance("generate_until", ("357+468=", {"until": ["5"], "max_gen_toks": 8})),
            instance("generate_until", ("9999+9999=", {"until": [], "max_gen_toks": 3})),
        ]
    )
    assert answers[:3] == ["8", "825", "82"]
    assert 1 <= len(answers[3]) <= 3  # 3 positions of the five-digit answer's 5 (one character per token)
    speed = lm.speed.task("t")
    assert speed.generated == 4 and speed.forwards > 0

    model, tokenizer = llada
    chat = DiffusionLM(loaded=llada, use_chat_template=True)
    history = [{"role": "user", "content": "Hello"}]
    rendered = chat.apply_chat_template(history)
    assert rendered == tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert rendered != "Hello" and chat._encode(rendered) == tokenizer.encode(rendered, add_special_tokens=False)


def test_task_yaml_that_runs_code_needs_the_confirmation(tmp_path, capsys, monkeypatch):
    """Issue 55.6(c): a local task with `!function` (lm-eval imports the directory's Python)
    or an `include:` from outside its directory is refused before anything loads unless
    --confirm-run-unsafe-code; the check reads the YAML as text and runs none of it."""
    monkeypatch.setattr(task_index, "BUILTIN_TASKS", False)
    for name, yaml in (
        ("fn", "task: t_fn\nprocess_docs: !function utils.process_docs\n"),
        ("inc", "include: ../../elsewhere/base.yaml\ntask: t_inc\n"),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "task.yaml").write_text(yaml)
        code, _, err = run_cli(capsys, "--model", "/nonexistent", "--tasks", f"t_{name}", "--include-path", str(folder))
        assert code == 2 and "--confirm-run-unsafe-code" in one_error_line(err), err
        code, _, err = run_cli(
            capsys,
            "--model",
            "/nonexistent",
            "--tasks",
            f"t_{name}",
            "--include-path",
            str(folder),
            "--confirm-run-unsafe-code",
        )
        assert "--confirm-run-unsafe-code" not in err  # (past the gate: it fails later, on the model or the task)


def test_task_data_that_cannot_be_read_is_one_line(tmp_path, capsys):
    """Issue 55.8: a task whose data file holds a malformed JSON line was datasets' traceback."""
    data = tmp_path / "addition.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", \n')
    (tmp_path / "demo_addition.yaml").write_text(ADDITION.format(data=data, cache=tmp_path / "hf-datasets"))
    code, _, err = run_cli(
        capsys, "--tasks", "demo_addition", "--include-path", str(tmp_path), "--output-dir", str(tmp_path / "out")
    )
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]  # (datasets prints its progress bar before it)
    assert last.startswith("error: the data of task demo_addition cannot be read: ArrowInvalid")


# -- the plot (evaluation.report.figure; issue 56.5)


def _rows(grid: bool) -> list:
    from mlx_lm_diffusion.evaluation.report import Row

    rows = []
    for k, (threshold, block) in enumerate([(0.5, 4), (0.5, 8), (0.9, 4), (0.9, 8)]):
        setting = {"threshold": threshold, "block_length": block} if grid else {"threshold": threshold + k / 100}
        label = " ".join(f"{n}={v}" for n, v in setting.items())
        rows.append(
            Row(
                label,
                "demo_addition",
                "exact_match",
                0.9 + 0.02 * k,
                0.01 * (k + 1),
                5.0 - k,
                100.0 * (4 - k),
                100,
                tuple(setting.items()),
            )
        )
    return rows


def test_pareto_front():
    from mlx_lm_diffusion.evaluation.report import pareto_front

    assert pareto_front([(1, 0.9), (2, 0.8), (3, 0.95), (0.5, 1.0), (3, 0.5)]) == [(0.5, 1.0), (3, 0.95)]
    assert pareto_front([]) == []


@pytest.mark.parametrize("grid", [False, True])
def test_the_plot_names_its_metric_with_error_bars_a_legend_and_the_front(grid):
    """The y axis names the metric and the task, every point carries its standard error, the
    settings are named in a legend (no label on the points), the Pareto front is drawn; a sweep
    over two options adds its heatmap."""
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from mlx_lm_diffusion.evaluation.report import figure

    fig = figure(_rows(grid))
    try:
        panels = fig.axes
        scatter = panels[:2]
        for ax in scatter:
            assert ax.get_ylabel() == "exact_match (demo_addition)"
            bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
            assert len(bars) == 4 and not ax.texts
            assert "Pareto front" in [line.get_label() for line in ax.lines]
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert set(r.setting for r in _rows(grid)) <= set(legend)
        heatmaps = [ax for ax in panels if ax.images]
        assert len(heatmaps) == (1 if grid else 0)
        if grid:
            assert (heatmaps[0].get_xlabel(), heatmaps[0].get_ylabel()) == ("block_length", "threshold")
            assert len(heatmaps[0].texts) == 4
    finally:
        plt.close(fig)


def test_the_bound_is_the_layout_the_adapter_declares(llada):
    """The likelihood bound (and the training objective's blocks) follow the adapter's
    declared `likelihood_layout`, not its infill refusal message, from which it was inferred
    (issue 52.2): a LLaDA adapter given a refusal stays on LLaDA's canvas bound."""
    from mlx_lm_diffusion.evaluation.layout import BoundLayout, bound_layout
    from model_adapters import adapter_for

    adapter = adapter_for(*llada)
    adapter.suffix_refusal = "a reason a suffix cannot be read"  # (before: any refusal meant "prefix")
    assert bound_layout(adapter).kind == "canvas"
    adapter.likelihood_layout = "prefix"
    assert bound_layout(adapter) == BoundLayout("prefix", adapter.block_length, needs_context=True)
    adapter.likelihood_layout = None
    with pytest.raises(ValueError, match="declares no likelihood bound"):
        bound_layout(adapter)
