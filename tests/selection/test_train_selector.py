"""hf_sparse_attention.training (``scripts/train_selector.py``) end to end on CPU with a tiny random Llama:
train, resume, load back; the distillation loss and the passkey data; ``scripts/compare_loss_curves.py``."""

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
import sparse_k
import torch

from hf_sparse_attention.training import distill
from hf_sparse_attention.training import train_selector as trainer
from hf_sparse_attention.training.data import TokenStream

COMPARE_LOSS_CURVES = Path(__file__).resolve().parents[2] / "scripts" / "compare_loss_curves.py"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama with a character-level tokenizer, saved like a hub model."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_llama")
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _args(model, out, steps, *extra):
    return ["--model", model, "--device", "cpu", "--seq-len", "160", "--sinks", "2", "--window", "24",
            "--top-k", "12", "--query-block", "16", "--global-batch", "3", "--micro-batch", "2",
            "--max-texts", "1", "--steps", str(steps), "--output-dir", out, "--no-progress", "--lr", "0.05", *extra]


def _selectors(path):
    from hf_sparse_attention.selectors import load_selectors

    return load_selectors(path)


def test_resume_latest_without_a_checkpoint_says_it_starts_afresh(tiny_model, tmp_path, capsys):
    """``--resume latest`` on an empty output folder (the first of several preemptible calls) trains from step 0 and
    says so."""
    out = str(tmp_path / "fresh")
    assert trainer.main(_args(tiny_model, out, 1, "--resume", "latest")) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    with open(os.path.join(out, "log.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1]


def test_train_resume_and_load_back(tiny_model, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert trainer.main(_args(tiny_model, straight, 4, "--save-every", "2")) == 0
    assert trainer.main(_args(tiny_model, split, 4, "--save-every", "2", "--max-minutes", "0")) == 0  # stops after 1 step
    # A run stopped by --max-minutes still leaves its latest selectors, equal to its last checkpoint.
    early = _selectors(os.path.join(split, "sparse_k_selectors.safetensors"))
    last = _selectors(os.path.join(split, "checkpoint-000001", "selectors.safetensors"))
    assert all(torch.equal(early[i].weight, last[i].weight) for i in early)
    assert trainer.main(_args(tiny_model, split, 4, "--save-every", "2", "--resume", "latest")) == 0

    with open(os.path.join(straight, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and r["loss"] == r["loss"] for r in log)
    a = _selectors(os.path.join(straight, "sparse_k_selectors.safetensors"))
    b = _selectors(os.path.join(split, "sparse_k_selectors.safetensors"))
    init = _selectors(os.path.join(split, "checkpoint-000001", "selectors.safetensors"))
    for i in a:
        # Same data and updates whether the run was split or not (CPU is deterministic here).
        torch.testing.assert_close(a[i].weight, b[i].weight, atol=1e-6, rtol=1e-5)
        assert not torch.equal(a[i].weight, init[i].weight)  # training moved the scorers

    from transformers import AutoModelForCausalLM

    from hf_sparse_attention.selectors import get_selectors, load_selectors_for_model

    with open(os.path.join(straight, "sparse_attention_config.json")) as f:
        cfg = json.load(f)
    assert cfg["pattern"] == "sparse_k" and cfg["top_k"] == 12
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.config.sparse_attention = cfg
    assert load_selectors_for_model(model)
    torch.testing.assert_close(get_selectors(model)[1].weight, a[1].weight)


def test_lm_loss_reaches_scorers_and_dsa_distill(tiny_model, tmp_path):
    out = str(tmp_path / "lm")
    assert trainer.main(_args(tiny_model, out, 1, "--loss", "both", "--global-batch", "1")) == 0
    init_gain = torch.log(torch.tensor(8.0))
    sel = _selectors(os.path.join(out, "sparse_k_selectors.safetensors"))
    # log_gain only learns through the attention (LM) loss: it must have moved.
    assert any(not torch.allclose(s.log_gain, init_gain.expand_as(s.log_gain)) for s in sel.values())

    out_dsa = str(tmp_path / "dsa")
    assert trainer.main(_args(tiny_model, out_dsa, 2, "--pattern", "dsa", "--indexer-heads", "2", "--indexer-dim", "8")) == 0
    dsa = _selectors(os.path.join(out_dsa, "sparse_k_selectors.safetensors"))
    assert all(type(s).__name__ == "LightningIndexer" and s.per_kv_head for s in dsa.values())
    with pytest.raises(SystemExit):
        trainer.parse_args(["--pattern", "dsa", "--loss", "lm"])
    with pytest.raises(SystemExit):
        trainer.parse_args(["--pattern", "dsa", "--no-per-kv-head", "--init", "attention"])
    # The measured recipes are the defaults (README table): dsa per query, per KV head, from the attention.
    args = trainer.parse_args(["--pattern", "dsa"])
    assert (args.query_block, args.indexer_heads, args.distill_blocks, args.init) == (1, 2, 256, "attention")
    assert (args.steps, args.lr, args.passkey_fraction, args.seq_len, args.global_batch) == (40, 1e-3, 0.5, 4096, 8)
    args = trainer.parse_args([])
    assert (args.pattern, args.query_block, args.steps, args.lr, args.distill_blocks) == ("sparse_k", 64, 150, 1e-2, 0)
    # With lr 0 the saved indexers are the attention initialisation: key maps pick rotary pairs
    # (i, i + D/2) of their own KV head, head weights +1 / -1.
    out_init = str(tmp_path / "dsa_init")
    assert trainer.main(_args(tiny_model, out_init, 1, "--pattern", "dsa", "--indexer-dim", "4", "--lr", "0")) == 0
    for sel in _selectors(os.path.join(out_init, "sparse_k_selectors.safetensors")).values():
        torch.testing.assert_close(sel.w_bias, torch.tensor([[1.0, -1.0]] * sel.num_kv_heads))
        picked = sel.k_weight.nonzero()[:, 2].view(sel.num_kv_heads, 4)  # (Hkv, d_I) kept dims
        assert torch.equal(picked[:, 2:], picked[:, :2] + sel.head_dim // 2)
    shared = str(tmp_path / "dsa_shared")
    assert trainer.main(_args(tiny_model, shared, 1, "--pattern", "dsa", "--no-per-kv-head")) == 0
    assert not any(s.per_kv_head for s in _selectors(os.path.join(shared, "sparse_k_selectors.safetensors")).values())

    # Per-query DSA (query_block 1) on sampled blocks, every sequence a passkey one (both styles),
    # with the answer-query term: runs, logs finite losses and moves the indexers.
    out_q = str(tmp_path / "dsa_q")
    assert trainer.main(_args(tiny_model, out_q, 2, "--pattern", "dsa", "--indexer-heads", "2", "--indexer-dim", "8",
                          "--query-block", "1", "--distill-blocks", "8", "--passkey-fraction", "1",
                          "--answer-weight", "4", "--seq-len", "400")) == 0
    with open(os.path.join(out_q, "log.jsonl")) as f:
        assert all(0 < json.loads(line)["loss"] < float("inf") for line in f)


def _refused(capsys, argv) -> str:
    """The ``error:`` line of ``trainer.main(argv)``, which must end with exit status 2."""
    with pytest.raises(SystemExit) as exc:
        trainer.main(argv)
    assert exc.value.code == 2, argv
    return capsys.readouterr().err


def test_help_says_what_every_flag_is_and_its_default():
    """``--help`` is the script's manual: every flag has a line saying what it is, with its default."""
    from helpers import undescribed_flags

    assert undescribed_flags(trainer.build_parser()) == []


def test_bad_sizes_are_refused_before_the_model_loads(tmp_path, capsys):
    """Every size is checked by the argument parser: ``--model`` names no model, so reaching the load would raise."""
    out = str(tmp_path / "run")
    missing = str(tmp_path / "no_model")
    for extra, message in [
        (["--query-block", "0"], "argument --query-block: expected a positive integer, got 0"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--top-k", "0"], "argument --top-k: expected a positive integer, got 0"),
        (["--window", "-3"], "argument --window: expected a positive integer, got -3"),
        (["--sinks", "-1"], "argument --sinks: expected an integer >= 0, got -1"),
        (["--save-every", "0"], "argument --save-every: expected a positive integer, got 0"),
        (["--log-every", "0"], "argument --log-every: expected a positive integer, got 0"),
        (["--lr", "-1"], "argument --lr: expected a number >= 0, got -1.0"),
        (["--seq-len", "20"], "--seq-len 20 is too short for --loss distill"),
        (["--seq-len", "38", "--query-block", "1"], "(with --query-block 1: --seq-len >= 39)"),
        (["--seq-len", "60", "--passkey-style", "landmark"], "--passkey-style landmark needs --seq-len >= 64"),
        (["--pattern", "dsa", "--indexer-dim", "3"], "--init attention needs an even indexer dim"),
        (["--resume", str(tmp_path / "nope")], "no such checkpoint directory"),
    ]:
        argv = _args(missing, out, 1, *extra)
        assert message in _refused(capsys, argv), extra
    # The shortest sequences that leave a block with more than top_k candidates pass.
    assert trainer.parse_args(_args(missing, out, 1, "--seq-len", "39", "--query-block", "1", "--passkey-fraction", "0"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message printed on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused(tmp_path, capsys):
    err = _refused(capsys, _args(str(tmp_path / "no_model"), str(tmp_path / "run"), 1, "--device", "cuda"))
    assert "--device cuda: CUDA is not available here" in err


def test_a_fresh_run_never_reuses_an_earlier_run(tiny_model, tmp_path, capsys):
    """A fresh run refuses a folder holding a run; ``--overwrite`` deletes that run's files only, so its log starts
    at step 1 and ``--resume latest`` picks the new run's checkpoint, not the old run's later one."""
    out = tmp_path / "run"
    assert trainer.main(_args(tiny_model, str(out), 4, "--save-every", "2")) == 0
    (out / "notes.txt").write_text("the user's own file\n")
    err = _refused(capsys, _args(tiny_model, str(out), 1))
    assert "holds an earlier run" in err and "--resume latest" in err and "--overwrite" in err
    assert "pass one of them" in _refused(capsys, _args(tiny_model, str(out), 1, "--overwrite", "--resume", "latest"))
    assert trainer.main(_args(tiny_model, str(out), 1, "--overwrite")) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000001"]
    assert (out / "notes.txt").exists()
    assert trainer.main(_args(tiny_model, str(out), 2, "--resume", "latest")) == 0
    capsys.readouterr()
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000001", "checkpoint-000002"]


def test_passkey_samples_mark_their_answer_queries(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    stream = TokenStream(tok, ["the quick brown fox jumps over the lazy dog. " * 40], 400, 0, 1.0, "mixed")
    styles = set()
    for slot in range(8):
        ids, ans = stream.sample(0, slot)
        assert ids.shape == ans.shape == (400,)
        spell = lambda t: "".join(tok.convert_ids_to_tokens(t.tolist()))  # character-level tokenizer
        text = spell(ids)
        styles.add("There is an important info" in text)
        key = text.rsplit("The pass key is", 1)[1].strip().rstrip(".")
        assert key.isdigit() and len(key) == 5
        # The answer queries predict " NNNNN.": the tokens after them spell the answer.
        assert spell(ids[1:][ans[:-1]]).strip() == f"{key}."
    assert styles == {True, False}
    blocks = distill.distill_blocks(sparse_k.SparseK(sinks=2, window=24, top_k=12, query_block=16), 400, 5, 0, 3, 1)
    assert blocks.tolist() == sorted(blocks.tolist()) and min(blocks.tolist()) >= 3 and len(set(blocks.tolist())) == 5


def test_distill_loss_is_zero_for_a_perfect_student():
    """The target is the dense block mass over the candidates: a student equal to log(mass) gives KL 0,
    and a uniform student does not."""
    from sparse_k.selection.scorers import SparseKScorer

    pattern = sparse_k.SparseK(sinks=1, window=6, top_k=3, query_block=4)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 8, generator=g)
    k = torch.randn(1, 1, 40, 8, generator=g)
    scale = 8 ** -0.5
    mass = distill.block_attention_mass(q, k, scale, 4)
    probs = torch.softmax((q @ k.transpose(-1, -2)) * scale + torch.full((40, 40), float("-inf")).triu(1), -1)
    torch.testing.assert_close(mass[0, 0, 3], probs[0, :, 12:16].sum((0, 1)))

    class Fixed(SparseKScorer):
        def __init__(self, logits):
            super().__init__(1, 8)
            self.fixed = logits

        def ranking_logits(self, value, positions, key=None):
            return self.fixed

    last = mass[:, :, 9]  # (1, 1, 40): the block of queries 36..39
    q_last = q[:, :, 36:]
    kl = distill.distill_loss(pattern, Fixed(torch.log(last.clamp_min(1e-30))), q_last, k, k, scale)
    assert float(kl.abs().max()) < 1e-5  # float32 logs of probabilities
    kl_uniform = distill.distill_loss(pattern, Fixed(torch.zeros(1, 1, 40)), q_last, k, k, scale)
    assert float(kl_uniform.min()) > 1e-3


def test_per_kv_head_dsa_distills_each_head_to_its_own_group():
    """Per-KV-head DSA: the target of KV head g is its own group's attention mass (KL 0 for a student
    equal to it, > 0 for the heads swapped)."""
    from sparse_k.selection.scorers import LightningIndexer

    pattern = sparse_k.DSA(sinks=1, window=6, top_k=3, query_block=1, indexer_heads=2, indexer_dim=4)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 40, 8, generator=g)
    k = torch.randn(1, 2, 40, 8, generator=g)
    scale = 8 ** -0.5
    last = distill.block_attention_mass(q, k, scale, 1)[:, :, 39]  # (1, Hkv, 40): the last query

    class Fixed(LightningIndexer):
        def __init__(self, logits):
            super().__init__(4, 2, 8, indexer_heads=2, indexer_dim=4, per_kv_head=True)
            self.fixed = logits

        def scores(self, q_index, w, k_index):
            return self.fixed[:, None]  # (1, N=1, Hkv, S)

    q_last = q[:, :, 39:]
    good = distill.distill_loss(pattern, Fixed(torch.log(last.clamp_min(1e-30))), q_last, k, k, scale)
    assert float(good.abs().max()) < 1e-5
    swapped = distill.distill_loss(pattern, Fixed(torch.log(last.flip(1).clamp_min(1e-30))), q_last, k, k, scale)
    assert float(swapped.min()) > 1e-3


def test_compare_loss_curves(tmp_path):
    """The command line (standard library only): exit status 0 within the tolerance, 1 beyond it, 2 without
    a common step; a repeated step (a resumed log) counts once, its last record."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"step": s, "loss": 2.0 - s / 100}) + "\n" for s in range(1, 21)))
    # Step 5 differs by 10% (before the skip), step 15 by 1.5%; a resumed log repeats step 20.
    b.write_text("".join(json.dumps({"step": s, "loss": (2.0 - s / 100) * (1.1 if s == 5 else 1.015 if s == 15 else 1.0)}) + "\n"
                         for s in [*range(1, 21), 20]))

    def run(*flags):
        return subprocess.run([sys.executable, str(COMPARE_LOSS_CURVES), str(a), str(b), *flags], capture_output=True,
                              text=True, timeout=60, check=False)

    ok = run("--skip", "10", "--tolerance", "0.02")
    assert ok.returncode == 0 and "PASS" in ok.stdout, ok.stdout + ok.stderr
    assert run("--skip", "10", "--tolerance", "0.01").returncode == 1
    assert run("--skip", "4", "--tolerance", "0.02").returncode == 1
    assert run("--skip", "30").returncode == 2
