"""Post-training with verifiable rewards: prompts, rewards, SFT, expert iteration, GRPO, evaluation.

Submodules are imported on use (``from scratchlm.align.grpo import grpo_train``); importing this
package imports nothing heavy. docs/post_training.md describes the pieces.
"""
