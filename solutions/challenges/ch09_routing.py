"""Challenge 09, one way: balance by a per-expert bias, no auxiliary loss, no capacity.

DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-AI 2024, §2.1.2):
add a bias b_i to expert i's score for the *choice* only, lower it for an overloaded expert
and raise it for an idle one, and repeat. The bias moves tokens that the router nearly
split between two experts; it never drops one. Here the loop runs on the batch itself (in
training it runs across steps), with a shrinking step, and keeps the most balanced choice."""
import torch


def route(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    scores = logits.float().softmax(-1)
    E = scores.shape[-1]
    bias = torch.zeros(E, device=scores.device)
    best = None
    for it in range(300):
        experts = (scores + bias).topk(top_k, dim=-1).indices
        load = torch.bincount(experts.flatten(), minlength=E).float()
        over = load.max() / load.mean()
        if best is None or over < best[0]:
            best = (over, experts)
        bias -= 0.01 * 0.99 ** it * (load - load.mean()) / load.mean()
    return best[1]
