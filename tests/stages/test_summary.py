"""What the SFT/alignment summary reports as its rates."""

from stitch.stages.supervised import WARMUP_STEPS, steady_rate


def test_steady_rate_leaves_out_the_warm_up_steps_and_takes_the_median():
    history = [{"tokens_per_s": 10.0}] * WARMUP_STEPS + [{"tokens_per_s": r} for r in (90.0, 100.0, 400.0)]
    assert steady_rate(history) == 100.0


def test_steady_rate_of_a_run_shorter_than_the_warm_up_uses_every_step():
    assert steady_rate([{"tokens_per_s": 5.0}, {"tokens_per_s": 7.0}]) == 6.0
    assert steady_rate([{"loss": 1.0}]) is None
