"""EAGLE-style draft heads (EAGLE-3), draft vocabulary maps, checkpoint save/load."""
from draft_models.checkpoint import DraftCheckpointError, draft_state_dict_for_sglang, load_draft, save_draft
from draft_models.config import Eagle3Config, Eagle3ConfigError
from draft_models.eagle3 import Eagle3Draft
from draft_models.ttt import ttt_loss, ttt_unroll
from draft_models.vocab import build_draft_vocab, draft_logits_to_target, restrict_logprobs, restrict_probs

__all__ = ["DraftCheckpointError", "Eagle3Config", "Eagle3ConfigError", "Eagle3Draft", "build_draft_vocab",
           "draft_logits_to_target", "draft_state_dict_for_sglang", "load_draft", "restrict_logprobs",
           "restrict_probs", "save_draft", "ttt_loss", "ttt_unroll"]
