"""The training example: the loss falls on the shipped text, a resumed run continues the same losses."""
import pytest
import torch

from autopar.examples import train_gpt

TINY = ["--mesh", "1,1,2", "--layers", "2", "--heads", "2", "--embd", "32", "--seq", "32", "--batch", "8",
        "--lr", "1e-2", "--deterministic", "--log-every", "100"]
STEPS, SAVED_AT = 40, 30
# ranks forked from the fork server: the training is what is tested here, not a rank's start-up
FORKED = "forkserver"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    result = train_gpt.run([*TINY, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                            "--checkpoint-every", str(SAVED_AT)], start_method=FORKED)
    return result, ckpt


def test_corpus_is_real_text_and_batches_are_shifted_windows():
    tokens = train_gpt.load_corpus()
    assert 100_000 <= tokens.numel() <= 500_000
    assert bytes(tokens[:2000].tolist()).decode("ascii").count(" ") > 200   # English prose, not data
    idx, tgt = train_gpt.get_batch(tokens, 4, 16, step=7, seed=3)
    assert idx.shape == tgt.shape == (4, 16) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], tgt[:, :-1])
    again, _ = train_gpt.get_batch(tokens, 4, 16, step=7, seed=3)
    other, _ = train_gpt.get_batch(tokens, 4, 16, step=8, seed=3)
    assert torch.equal(idx, again) and not torch.equal(idx, other)


def test_loss_falls(first_run):
    result, _ = first_run
    losses = result["losses"]
    assert result["first_step"] == 1 and len(losses) == STEPS
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)   # uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1


def test_resume_continues_the_same_losses(first_run):
    result, ckpt = first_run
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{SAVED_AT:06d}", f"step-{STEPS:06d}"]
    resumed = train_gpt.run([*TINY, "--steps", str(SAVED_AT + 5), "--resume", str(ckpt / f"step-{SAVED_AT:06d}")],
                            start_method=FORKED)
    assert resumed["first_step"] == SAVED_AT + 1
    assert resumed["losses"] == result["losses"][SAVED_AT:SAVED_AT + 5]   # deterministic mode: bit for bit


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "2,1,1", "--batch", "3"], "--batch 3 is not divisible by dp=2"),
    (["--resume"], "--resume without a PATH needs --checkpoint-dir"),
    (["--embd", "30", "--heads", "4"], "--embd 30 is not a multiple of --heads 4"),
])
def test_bad_options_fail_before_any_rank_starts(capsys, argv, message):
    assert train_gpt.main(argv) == 2
    assert message in capsys.readouterr().err
