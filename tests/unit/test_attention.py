"""``model.attention``: the probe over SDPA kernels on a tiny SD3's real blocks (the kernels this CPU build
has: math and flash; efficient and cuDNN are CUDA-only and must be rejected with their reason), a kernel made
to fail rejected, a named kernel checked and applied process-wide, the compile caches tagged with it, and the
config field (choices, the retired ``cudnn_attention``)."""

from __future__ import annotations

import logging

import pytest
import tiny_models as testing
import torch
from torch import nn

from trainer.config import ConfigError, load_config
from trainer.models import build_adapter
from trainer.models.attention import attention_for_run, block_step, probe, use_attention
from trainer.models.compiling import compile_denoiser, repeated_blocks
from trainer.rollout import SamplerSettings

CUDA_ONLY = ("efficient", "cudnn")


@pytest.fixture(autouse=True)
def torch_default_attention():
    """Every test starts and ends with torch's default kernels (the setting is process-wide)."""
    use_attention("auto")
    yield
    use_attention("auto")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return build_adapter(testing.tiny_config("sd3", tmp_path_factory.mktemp("models")), "cpu")


def _cond(adapter):
    return adapter.encode_prompts(["a photo of a cat"], None)


def _step(adapter):
    """A forward+backward of the tiny SD3's blocks (each block class's first call), as a run's probe has it."""
    sigma = adapter.sigmas(3)[:1]
    cond = _cond(adapter)
    latents = adapter.prepare_latents(1, torch.Generator().manual_seed(0))

    def forward():
        return adapter.predict(adapter.denoiser, latents, sigma, cond, 3.0)

    return block_step(repeated_blocks(adapter.denoiser), forward)


def _flash_only() -> bool:
    cuda = torch.backends.cuda
    return cuda.flash_sdp_enabled() and not cuda.math_sdp_enabled()


def test_probe_keeps_the_kernels_that_run_and_match_math(adapter):
    step = _step(adapter)
    results = step()
    assert len(results) >= 3 and all(torch.isfinite(t).all() for t in results)  # outputs and input gradients
    assert all(p.grad is None for p in adapter.denoiser.parameters())  # the probe touches no .grad
    choice = probe(step, ["flash", *CUDA_ONLY, "math"], torch.float32, repeats=2)
    verdicts = {v.kernel: v for v in choice.verdicts}
    assert verdicts["flash"].passed and verdicts["math"].passed and verdicts["flash"].seconds > 0
    for kernel in CUDA_ONLY:  # not in this CPU build: rejected with torch's own reason, the probe goes on
        assert not verdicts[kernel].passed and not verdicts[kernel].runs
        assert "No viable backend" in verdicts[kernel].reason
    fastest = min((v for v in choice.verdicts if v.passed), key=lambda v: v.seconds)
    assert choice.kernel == fastest.kernel
    assert "efficient rejected (No viable backend" in choice.summary()


def test_probe_rejects_a_kernel_whose_blocks_give_nan_or_drift(adapter):
    """The real blocks, wrapped so that under flash alone one output is NaN (or 5% off): flash is rejected
    with the reason and the choice is math, the reference."""
    step = _step(adapter)

    def nan_under_flash():
        results = step()
        if _flash_only():
            results[0] = results[0] * float("nan")
        return results

    def drift_under_flash():
        results = step()
        if _flash_only():
            results[-1] = results[-1] * 1.05
        return results

    for broken, reason in (
        (nan_under_flash, "non-finite values in tensor 1"),
        (drift_under_flash, "relative error 0.05 > 0.005"),
    ):
        choice = probe(broken, ["flash", "math"], torch.float32, repeats=1)
        flash = choice.verdicts[0]
        assert choice.kernel == "math" and not flash.passed and flash.runs, choice.summary()
        assert reason in flash.reason and f"flash rejected ({flash.reason})" in choice.summary()
    record = choice.record()
    assert record["kernel"] == "math" and record["flash_ms"] is None and "relative error" in record["flash_rejected"]


def test_probe_falls_back_to_math_when_no_candidate_passes(adapter):
    choice = probe(_step(adapter), list(CUDA_ONLY), torch.bfloat16, repeats=1)
    assert choice.kernel == "math" and not any(v.passed for v in choice.verdicts)


def test_named_kernel_is_checked_then_set_for_the_process(adapter):
    sampler = SamplerSettings(num_steps=3, guidance_scale=3.0)
    choice = attention_for_run(adapter, "flash", _cond(adapter), sampler)
    assert choice.kernel == "flash" and choice.verdicts[0].passed
    cuda = torch.backends.cuda
    assert (
        cuda.flash_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
    ) == (True, True, False, False)  # flash where it runs, math the rest
    with pytest.raises(
        ValueError,
        match=r"^model.attention=efficient cannot run this model's blocks on cpu "
        r"\(No viable backend.*\); use auto or one of math, flash$",
    ):
        attention_for_run(adapter, "efficient", _cond(adapter), sampler)
    auto = attention_for_run(adapter, "auto", _cond(adapter), sampler)  # on the CPU: torch's order, no probe
    assert auto.kernel == "default" and not auto.verdicts
    assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and not cuda.cudnn_sdp_enabled()  # UNPROBED


def test_a_trainer_sets_the_named_kernel_before_compiling_and_says_so(tmp_path, tiny_model_dir, capsys):
    """The run's choice is made as the Trainer is built (before model.compile), printed and logged."""
    from warm_start import tiny_trainer

    trainer = tiny_trainer(tmp_path, tiny_model_dir, "model.attention=flash")
    assert trainer.attention.kernel == "flash" and not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert "model.attention=flash: flash (blocks forward+backward: flash " in capsys.readouterr().out
    (record,) = [r for r in trainer.logger.history if r["phase"] == "attention"]
    assert record["kernel"] == "flash" and record["flash_ms"] > 0


def test_compiling_tags_its_caches_with_the_kernels():
    """Inductor's cache keys leave the SDPA kernel out (pytorch#185449): the tag puts it in, so a graph compiled
    under one kernel is not reused under another (by another run sharing the cache directory)."""
    net = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(2)]))
    use_attention("flash")
    compile_denoiser(net, "blocks")
    assert torch.compiler.config.cache_key_tag.endswith("|sdpa=math,flash")
    use_attention("math")
    compile_denoiser(net, "blocks")
    assert torch.compiler.config.cache_key_tag.endswith("|sdpa=math")
    assert torch.compiler.config.cache_key_tag.count("|sdpa=") == 1


def test_config_names_the_choices_and_reads_the_retired_cudnn_switch(caplog):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["model.attention=fastest"])
    assert str(error.value) == (
        "model.attention: 'fastest' is not one of 'auto', 'math', 'flash', 'efficient', 'cudnn'"
    )
    assert load_config().model.attention == "auto"
    with caplog.at_level(logging.WARNING):
        assert load_config(overrides=["model.cudnn_attention=true"]).model.attention == "cudnn"
        assert load_config(overrides=["model.cudnn_attention=false"]).model.attention == "auto"
        assert (
            load_config(overrides=["model.attention=flash", "model.cudnn_attention=false"]).model.attention == "flash"
        )
    warnings = [r.getMessage() for r in caplog.records if "cudnn_attention" in r.getMessage()]
    assert len(warnings) == 3 and "model.cudnn_attention is deprecated and read as model.attention=cudnn" in warnings[0]
