"""Notebook 08: the speculative acceptance rule and the rollback of rejected drafts.

Each wrong function is the notebook's solution cell with one change a learner makes."""
import torch

from gpulab.grading import speculative as _speculative_checks  # noqa: F401  (registers the checks)

from . import Mistake


def _accept(mistake=""):
    def accept(draft, q, p, gen):
        p, q = p.double(), q.double()
        for i, x in enumerate(draft):
            u = torch.rand((), generator=gen, dtype=torch.float64)
            if mistake == "q over p":
                keep = p[i, x] > 0 and u * p[i, x] <= q[i, x]
            elif mistake == "accept with probability p":
                keep = u <= p[i, x]
            else:
                keep = q[i, x] > 0 and u * q[i, x] <= p[i, x]
            if keep:
                continue
            if mistake == "keeps going after a rejection":
                continue
            if mistake == "replacement from p":
                residual = p[i]
            elif mistake == "residual from the next position":
                residual = (p[i + 1] - q[i]).clamp_min(0)
            elif mistake == "residual without clamping":
                residual = (p[i] - q[i]).abs()
            else:
                residual = (p[i] - q[i]).clamp_min(0)
            return list(draft[:i]) + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
        k = len(draft)
        if mistake == "no bonus token":
            return list(draft)
        if mistake == "keeps going after a rejection":
            return list(draft)[:k] + [int(torch.multinomial(p[k] / p[k].sum(), 1, generator=gen))]
        bonus = p[k - 1] if mistake == "bonus from the last draft's position" and k else p[k]
        return list(draft) + [int(torch.multinomial(bonus / bonus.sum(), 1, generator=gen))]
    return accept


def _rollback(mistake=""):
    def rollback(seq, block_manager, n_drafts, n_accepted):
        if mistake == "cuts every draft":
            del seq.token_ids[seq.num_tokens - n_drafts:]
        elif mistake == "keeps one rejected draft":
            del seq.token_ids[seq.num_tokens - (n_drafts - n_accepted) + 1:]
        else:
            del seq.token_ids[seq.num_tokens - (n_drafts - n_accepted):]
        seq.num_computed_tokens += n_accepted if mistake == "last token not counted" else 1 + n_accepted
        if mistake == "pages kept":
            return
        keep = block_manager.blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            if mistake == "pages dropped, not released":
                seq.block_table.pop()
            elif mistake == "first pages released":
                block_manager.release_block(seq.block_table.pop(0))
            else:
                block_manager.release_block(seq.block_table.pop())
    return rollback


def _acc(name, mistake, expect, **kw):
    return Mistake("08/check-accept", "speculative-acceptance", name, _accept(mistake), expect, **kw)


def _rb(name, mistake, expect, **kw):
    return Mistake("08/check-rollback", "speculative-rollback", name, _rollback(mistake), expect, **kw)


MISTAKES = [
    _acc("ratio upside down (q / p)", "q over p", ("p over q",)),
    _acc("accepts with probability p(x)", "accept with probability p", ("p(x) / q(x)",)),
    _acc("replacement sampled from p", "replacement from p", ("max(0, p - q)", "max(0, p[i] - q[i])")),
    _acc("residual from the next position", "residual from the next position", ("rejected position",)),
    _acc("residual |p - q| instead of max(0, p - q)", "residual without clamping", ("max(0, p - q)", "max(0, p[i] - q[i])")),
    _acc("no bonus token", "no bonus token", ("bonus token",)),
    _acc("bonus from the last draft's position", "bonus from the last draft's position", ("p[k]",)),
    _acc("keeps going after a rejection", "keeps going after a rejection", ("stop at the first rejection",)),
    _rb("rejected drafts' pages kept", "pages kept", ("release the pages past",)),
    _rb("last committed token not counted", "last token not counted", ("the last committed token",)),
    _rb("cuts the accepted drafts too", "cuts every draft", ("keep the committed tokens and the accepted drafts",)),
    _rb("keeps one rejected draft", "keeps one rejected draft", ("keep the committed tokens and the accepted drafts",)),
    _rb("pages dropped from the table, not released", "pages dropped, not released", ("release_block",)),
    _rb("first pages released instead of the last", "first pages released", ("last page first",)),
]
