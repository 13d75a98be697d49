import pytest
import torch

from drafter.model.eagle3 import DraftCache
from drafter.train.loss import (
    StepStats,
    pred_mask_from_loss_mask,
    simulated_accept_len,
    target_draft_logits,
    ttt_loss,
)
from tests.helpers.drafters import FAMILIES, tiny_drafter


def _batch(model, b=4, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * cfg.target_hidden, generator=g)
    last = torch.randn(b, t, cfg.hidden_size, generator=g)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    return ids, aux, last, head


def test_future_positions_do_not_leak_into_earlier_ones():
    model = tiny_drafter()
    ids, aux, _, _ = _batch(model, b=1, t=16)
    out = model(ids, aux, ttt_length=3)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[:, 12:] = (ids2[:, 12:] + 1) % model.config.vocab_size
    aux2[:, 12:] += 1.0
    out2 = model(ids2, aux2, ttt_length=3)
    for j in range(3):
        # step j at position t reads token t+j+1, so positions < 12-j-1 are untouched
        n = 12 - j - 1
        assert torch.allclose(out[j][:, :n], out2[j][:, :n], atol=1e-5)
        assert not torch.allclose(out[j][:, n:], out2[j][:, n:])


def test_padding_is_never_attended():
    model = tiny_drafter()
    ids, aux, _, _ = _batch(model, b=1, t=10)
    mask = torch.ones(1, 14, dtype=torch.long)
    mask[:, 10:] = 0
    padded_ids = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    padded_aux = torch.cat([aux, torch.randn(1, 4, aux.shape[-1]) * 50], dim=1)
    a = model(ids, aux, ttt_length=2)
    b = model(padded_ids, padded_aux, attention_mask=mask, ttt_length=2)
    assert torch.allclose(a[0], b[0][:, :10], atol=1e-5)
    # step 1 reads token t+2, which for the last two real positions comes from the pad area
    assert torch.allclose(a[1][:, :8], b[1][:, :8], atol=1e-5)


def _decoding_equals_training(window, k) -> bool:
    model = tiny_drafter(seed=3, sliding_window=window)
    ids, aux, _, _ = _batch(model, b=1, t=12, seed=5)
    n, cache = 7, DraftCache()
    hidden = model.extend(cache, ids[0, 1 : n + 2], aux[0, : n + 1])
    tokens, dists = model.propose(cache, hidden[:, -1:], k, temperature=1.0, generator=torch.Generator().manual_seed(0))
    seq = torch.cat([ids[0, : n + 2], tokens[:-1]])[None]
    full_aux = torch.cat([aux[:, : n + 1], torch.randn(1, seq.shape[1] - n - 1, aux.shape[-1])], dim=1)
    steps = model(seq, full_aux, ttt_length=k)
    return all(
        torch.allclose(torch.softmax(steps[j][0, n].float(), -1), dists[j][model.t2d], atol=1e-5) for j in range(k)
    )


def test_a_window_the_draft_chain_outreaches_is_refused_where_training_and_decoding_part():
    """Attack: a sliding window shorter than the draft chain. Training and decoding agree up to window + 1
    steps and part after; check_depth refuses exactly there."""
    from common.errors import BadInput
    from drafter.model.config import check_depth

    for window, k in [(2, 3), (2, 4), (3, 4), (3, 5)]:
        agree = _decoding_equals_training(window, k)
        assert agree == (k <= window + 1), (window, k)
        cfg = tiny_drafter(sliding_window=window).config
        if agree:
            check_depth(cfg, k, "ttt_length")
        else:
            with pytest.raises(BadInput, match=f"ttt_length {k} reach past the drafter's sliding_window {window}"):
                check_depth(cfg, k, "ttt_length")


@pytest.mark.parametrize(
    ("window", "family"), [(None, "llama"), (5, "llama"), *[(None, f) for f in FAMILIES if f != "llama"]]
)
def test_decoding_path_matches_the_ttt_training_forward(window, family):
    """What is trained is what is served: propose()'s draft distributions equal the TTT steps', with
    and without a sliding window, for every draft layer family and the EAGLE-3.1 norms."""
    model = tiny_drafter(seed=3, sliding_window=window, **FAMILIES[family])
    cfg = model.config
    ids, aux, _, _ = _batch(model, b=1, t=12, seed=5)
    n, k = 7, 4
    cache = DraftCache()
    hidden = model.extend(cache, ids[0, 1 : n + 2], aux[0, : n + 1])
    gen = torch.Generator().manual_seed(0)
    tokens, dists = model.propose(cache, hidden[:, -1:], k, temperature=1.0, generator=gen)
    assert cache.length == n + 1  # drafts never enter the cache
    seq = torch.cat([ids[0, : n + 2], tokens[:-1]])[None]
    full_aux = torch.cat([aux[:, : n + 1], torch.randn(1, seq.shape[1] - n - 1, aux.shape[-1])], dim=1)
    steps = model(seq, full_aux, ttt_length=k)
    for j in range(k):
        train_probs = torch.softmax(steps[j][0, n].float(), -1)
        assert torch.allclose(train_probs, dists[j][model.t2d], atol=1e-5), j
        assert bool(model.t2d[tokens[j]])
    assert dists.shape == (k, cfg.vocab_size)
    assert torch.allclose(dists.sum(-1), torch.ones(k), atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_extend_equals_one_shot_extend(family):
    model = tiny_drafter(seed=1, **FAMILIES[family])
    ids, aux, _, _ = _batch(model, b=1, t=10)
    one = DraftCache()
    h1 = model.extend(one, ids[0, 1:10], aux[0, :9])
    two = DraftCache()
    model.extend(two, ids[0, 1:5], aux[0, :4])
    h2 = model.extend(two, ids[0, 5:10], aux[0, 4:9])
    assert torch.allclose(h1[:, 4:], h2, atol=1e-5)
    assert torch.allclose(one.keys, two.keys, atol=1e-5)
    two.crop(3)
    assert two.length == 3


def test_ttt_loss_falls_and_accuracy_rises_when_overfitting_one_batch():
    torch.manual_seed(0)
    model = tiny_drafter(seed=2)
    ids, aux, last, head = _batch(model, b=2, t=20, seed=1)
    head_rows = head[model.t2d]
    draft = (last @ head_rows.T).argmax(-1)
    target_token = model.draft_to_target(draft)  # every target proposable (an OOV one is a sure miss)
    pred_mask = torch.ones(2, 20, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    history = []
    for _ in range(150):
        steps = model(ids, aux, ttt_length=3)
        loss, _, stats = ttt_loss(
            steps, target_draft_logits(last, head_rows), target_token, pred_mask, model.t2d, model.d2t
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.item(), stats.accuracy))
    first, last_ = history[0], history[-1]
    assert last_[0] < 0.5 * first[0]
    for j in range(3):
        assert last_[1][j] > first[1][j] + 0.3
    assert last_[1][0] > 0.9


def test_step_stats_conditional_acceptance_and_sim_accept_len():
    # 1 sample, T=5, vocab where draft == target ids; craft logits so that correctness is known.
    vd = 4
    t2d = torch.ones(vd, dtype=torch.bool)
    d2t = torch.zeros(vd, dtype=torch.long)
    target_token = torch.tensor([[0, 1, 2, 3, 0]])
    target_logits = torch.nn.functional.one_hot(target_token, vd).float() * 10
    pred_mask = torch.ones(1, 5, dtype=torch.bool)

    def logits_for(tokens):
        return torch.nn.functional.one_hot(torch.tensor([tokens]), vd).float() * 10

    # step 0 predicts targets at positions 1..4: correct at t=0,1,2, wrong at 3
    s0 = logits_for([1, 2, 3, 1, 0])
    # step 1 predicts targets at positions 2..4: correct at t=0, wrong at t=1, correct at t=2
    s1 = logits_for([2, 0, 0, 0, 0])
    _, _, stats = ttt_loss([s0, s1], target_logits, target_token, pred_mask, t2d, d2t)
    assert stats.accuracy == [0.75, 2 / 3]
    # conditional: step 1 counted only where step 0 was right and step 1 is valid (t=0,1,2): 2 of 3
    assert stats.conditional_acceptance == [0.75, 2 / 3]
    assert abs(stats.sim_accept_len - (1 + 0.75 + 0.75 * 2 / 3)) < 1e-9
    total = stats + StepStats(*(torch.zeros(2, dtype=torch.float64) for _ in range(4)))
    assert total.accuracy == stats.accuracy
    assert simulated_accept_len([1.0, 1.0, 1.0]) == 4.0


def test_pred_mask_shifts_assistant_mask():
    lm = torch.tensor([0, 0, 1, 1, 0, 1])
    assert pred_mask_from_loss_mask(lm).tolist() == [False, True, True, False, True, False]


def test_ttt_forward_on_the_scored_positions_only_gives_the_same_loss_and_gradients():
    """With pred_mask the forward skips what no loss reads (prompt positions after step 0's keys):
    the loss, its gradients and the counts equal the full computation's."""
    from drafter.train.loss import pred_mask_from_loss_mask, ttt_loss

    torch.manual_seed(0)
    model = tiny_drafter(seed=3)
    b, t, vd = 2, 24, model.config.draft_vocab_size
    ids = torch.randint(0, model.config.vocab_size, (b, t))
    aux = torch.randn(b, t, 3 * model.config.hidden_size)
    attention = torch.ones(b, t, dtype=torch.bool)
    attention[1, 20:] = False  # a padded row
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[0, 10:] = True  # an assistant turn after a prompt
    loss_mask[1, 5:9] = True
    loss_mask[1, 14:18] = True
    mask = pred_mask_from_loss_mask(loss_mask) & attention
    target = torch.randn(b, t, vd)
    tokens = torch.randint(0, model.config.vocab_size, (b, t))

    def run(sparse: bool):
        model.zero_grad()
        steps = model(ids, aux, attention, ttt_length=3, pred_mask=mask if sparse else None)
        loss, _, stats = ttt_loss(steps, target, tokens, mask, model.t2d, model.d2t)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, stats

    full, sparse = run(False), run(True)
    assert torch.allclose(full[0], sparse[0], atol=1e-5)
    assert full[1].keys() == sparse[1].keys()
    for name in full[1]:
        assert torch.allclose(full[1][name], sparse[1][name], atol=1e-5), name
    assert torch.equal(full[2].correct, sparse[2].correct) and torch.equal(full[2].chain_total, sparse[2].chain_total)
