"""TRL's own on-policy distillation losses on given logits, run in a virtualenv that has TRL (not the trainer's), from a
folder where this repository cannot shadow a module (tests/test_distill.py runs it with cwd=/tmp):

    /tmp/trl-venv/bin/python tests/peer_trl_distill.py IN.pt OUT.pt

IN.pt (torch.save, tensors only): student_logits [B, K, V], teacher_logits [B, K, V], mask [B, K] (1 = a completion
position), temperature (0-d). OUT.pt: for TRL's DistillationTrainer loss (trl/trainer/distillation_trainer.py
_chunked_divergence_loss, beta = 1: the reverse KL, fed the logits as hidden states through identity LM heads) and
GKDTrainer.generalized_jsd_loss (trl/experimental/gkd, beta = 1, labels -100 off the mask): the loss and its gradient
with respect to the student's logits, and the versions. Only torch and trl are imported.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
warnings.filterwarnings("ignore")


def main(src: str, dst: str) -> None:
    import torch
    import transformers
    import trl
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    data = torch.load(src, weights_only=True)
    s, t, mask, temp = data["student_logits"].double(), data["teacher_logits"].double(), data["mask"], float(data["temperature"])
    V = s.shape[-1]
    out: dict = {}

    s1 = s.float().clone().requires_grad_(True)
    eye = torch.eye(V)
    loss, _, n = _chunked_divergence_loss(s1, t.float(), eye, eye, mask, beta=1.0, temperature=temp)
    loss.backward()
    out["distillation_loss"], out["distillation_grad"] = loss.detach(), s1.grad.detach()

    s2 = s.clone().requires_grad_(True)
    labels = torch.where(mask.bool(), torch.zeros_like(mask, dtype=torch.long), torch.full_like(mask, -100, dtype=torch.long))
    gkd = GKDTrainer.generalized_jsd_loss(s2, t, labels=labels, beta=1.0, temperature=temp)
    gkd.backward()
    out["gkd_loss"], out["gkd_grad"] = gkd.detach(), s2.grad.detach()
    torch.save(out, dst)
    print(f"trl {trl.__version__} torch {torch.__version__} transformers {transformers.__version__}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
