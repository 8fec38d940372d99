"""specrl in your own RL loop: your policy, your reward, your trainer, and the co-training plug-in
in four calls. Run: `python -m experiments.own_loop` (the README quotes this file; CI runs it)."""
import torch

from rollout.engine import EmbeddedEngine
from rollout.protocol import SamplingParams
from specrl.config import CoTrainConfig, DraftTrainConfig, SchedulerConfig
from specrl.cotrain import SpecCoTrainer, brief
from specrl.drafts import new_draft
from target_training.config import model_config_for

torch.manual_seed(0)
policy = model_config_for("tiny", vocab_size=64).build()  # your policy (an HF model: target_training.hf_adapter)
optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-4)
prompts = [torch.randint(3, 64, (8,)).tolist() for _ in range(4)] * 4  # 4 prompts, 4 answers each
draft = new_draft(policy, prompts, DraftTrainConfig(draft_vocab_size=64))  # an EAGLE-3 head (untrained here)
engine = EmbeddedEngine(policy)  # speculative and lossless: the tokens and log-probs of plain decoding
cotrain = SpecCoTrainer(draft, CoTrainConfig(mode="online", feature_source="engine", min_buffer_records=1,
                                             scheduler=SchedulerConfig(min_budget_s=1.0)))  # draft time per step
cotrain.attach(engine)  # no feature hook in this trainer: the engine's verify forwards feed the draft
params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(2,))

for step in range(6):
    cotrain.begin_step()
    trajs = engine.generate(prompts, params, request_ids=range(16 * step, 16 * step + 16),
                            capture_features=cotrain.capture_engine_features)
    cotrain.on_rollout(trajs)  # acceptance and the rollout's figures
    rewards = torch.tensor([1.0 - len(t.token_ids) / 24 for t in trajs])  # your reward: shorter answers
    loss = 0.0
    for t, advantage in zip(trajs, rewards - rewards.mean()):  # your trainer: REINFORCE
        ids = torch.tensor([t.prompt_ids + t.token_ids])
        logp = policy(ids).logits[0, len(t.prompt_ids) - 1:-1].log_softmax(-1)
        loss = loss - advantage * logp.gather(1, torch.tensor(t.token_ids)[:, None]).sum() / len(trajs)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # the engine decodes with `policy` itself: nothing to sync
    metrics = cotrain.end_step()  # the step boundary: draft updates, hot swap; a dict for your logger
    print(f"step {step}: reward {rewards.mean():.3f}; {brief(metrics)}")
