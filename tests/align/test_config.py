"""The post-training configs' notes on options a command never reads."""

import pytest

from scratchlm.align.config import DPORunConfig, ExpertIterationRunConfig, GRPORunConfig, SFTRunConfig
from scratchlm.config import load_config


@pytest.mark.parametrize("config_cls, overrides, note", [
    (SFTRunConfig, ["--sampling.temperature=0.7", "--sampling.max_new_tokens=64"],
     "sampling.temperature=0.7, sampling.max_new_tokens=64 have no effect (scratchlm sft draws no rollouts; its "
     "evaluations decode greedily up to sampling.eval_max_new_tokens)"),
    (SFTRunConfig, ["--sft.pack_length=256"],
     "sft.pack_length=256 has no effect (sft.packed=false: the pairs are padded, not packed)"),
    (ExpertIterationRunConfig, ["--sft.num_epochs=3"],
     "sft.num_epochs=3.0 has no effect (each expert-iteration step fine-tunes for ei.sft_epochs epochs over its "
     "kept responses)"),
    (GRPORunConfig, ["--grpo.cliprange=0.1"],
     'grpo.cliprange=0.1 has no effect (it clips grpo_clip\'s ratio; this run\'s is '
     'grpo.loss_type="reinforce_with_baseline")'),
    (GRPORunConfig, ["--grpo.length_normalization=mean", "--grpo.normalize_constant=512"],
     'grpo.normalize_constant=512.0 has no effect (grpo.length_normalization="mean" averages over each response)'),
    (GRPORunConfig, ["--grpo.normalize_by_std=false", "--grpo.advantage_eps=0.01"],
     "grpo.advantage_eps=0.01 has no effect (grpo.normalize_by_std=false: advantages are not divided by the "
     "group's std)"),
    (GRPORunConfig, ["--grpo.loss_type=no_baseline", "--grpo.normalize_by_std=false"],
     'grpo.normalize_by_std=false has no effect (grpo.loss_type="no_baseline" trains on the raw rewards, not on '
     'advantages)'),
    (DPORunConfig, ["--data.eval_path=pairs.jsonl", "--data.eval_fraction=0.2"],
     "data.eval_fraction=0.2 has no effect (data.eval_path is set: the held-out pairs come from it, none from "
     "data.train_path)"),
])
def test_options_a_command_never_reads_are_named(config_cls, overrides, note):
    assert load_config(config_cls, None, overrides).ignored_options() == [note]


@pytest.mark.parametrize("config_cls, overrides", [
    (SFTRunConfig, ["--sampling.eval_max_new_tokens=64", "--sampling.batch_size=8", "--sft.num_epochs=3"]),
    (SFTRunConfig, ["--sft.packed=true", "--sft.pack_length=256"]),
    (ExpertIterationRunConfig, ["--sampling.temperature=0.7", "--ei.sft_epochs=3"]),
    (GRPORunConfig, ["--grpo.loss_type=grpo_clip", "--grpo.cliprange=0.1", "--grpo.advantage_eps=0.01"]),
    (GRPORunConfig, ["--grpo.length_normalization=constant", "--grpo.normalize_constant=512"]),
    (DPORunConfig, ["--data.eval_fraction=0.2"]),
])
def test_options_a_command_reads_are_not_named(config_cls, overrides):
    assert load_config(config_cls, None, overrides).ignored_options() == []


@pytest.mark.parametrize("config_cls, preset", [
    (SFTRunConfig, "align-sft"), (ExpertIterationRunConfig, "align-ei"), (GRPORunConfig, "align-grpo"),
    (DPORunConfig, "dpo"),
])
def test_the_presets_set_no_option_their_command_ignores(config_cls, preset):
    assert load_config(config_cls, preset, []).ignored_options() == []
