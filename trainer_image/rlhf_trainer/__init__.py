"""rlhf_trainer: the ZeRO-3 PPO trainer with vLLM rollout engines, run as a Ray job."""
