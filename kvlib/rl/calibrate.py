"""CPU calibration of the task's difficulty with the real model (issue 27): ``python -m kvlib.rl.calibrate``.

``python -m kvlib.rl.calibrate NAME SHOTS N_QUESTIONS K MAX_NEW_TOKENS DIFFICULTY_JSON`` samples ``K`` responses
to each of ``N_QUESTIONS`` held-out problems (seed 777) at temperature 1, no top-k/top-p, from SmolLM2-135M-Instruct
(shipped GGUF, dequantised, fp32, CPU), with the runs' prompt (:func:`kvlib.rl.task.prompt_fn`: ``SHOTS`` worked
examples at the same difficulty, chat template), and prints one JSON line: accuracy (exact match on the last box),
mean response tokens, the fraction that ended (EOS), prompt tokens. The numbers behind
:data:`kvlib.rl.task.DIFFICULTY` are in :data:`kvlib.rl.task.CPU_CALIBRATION`.

CPU cost: the shared few-shot prefix (everything before the last user turn) is prefilled once and its
``DynamicCache`` copied per question (repeated ``K`` times), so a question costs only its suffix and decode.
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch


def main(argv: list[str]) -> int:
    from transformers import DynamicCache

    from kvlib.hf.model import load_model
    from kvlib.rl import task

    if len(argv) != 6:
        raise ValueError("usage: NAME SHOTS N_QUESTIONS K MAX_NEW_TOKENS DIFFICULTY_JSON")
    name, shots, nq, k, mnt = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    diff = json.loads(argv[5])
    model, tok = load_model(dtype=torch.float32, device="cpu")
    model.config._attn_implementation = "sdpa"
    probs = task.make_problems("heldout", nq, seed=777, **diff)
    pf = task.prompt_fn(shots=shots, **diff)
    gen = torch.Generator().manual_seed(0)
    ids = [tok(pf(tok, p), add_special_tokens=False)["input_ids"] for p in probs]
    n = 0
    while all(len(x) > n and x[n] == ids[0][n] for x in ids):
        n += 1
    n -= 1  # keep at least one token of every suffix
    t0 = time.time()
    with torch.no_grad():
        prefix = DynamicCache()
        model(input_ids=torch.tensor([ids[0][:n]]), past_key_values=prefix, use_cache=True)
    res = []
    eos = tok.eos_token_id
    for qi, (p, x) in enumerate(zip(probs, ids, strict=True)):
        print(qi, round(time.time() - t0, 1), file=sys.stderr, flush=True)
        c = copy.deepcopy(prefix)
        c.batch_repeat_interleave(k)
        out: list[list[int]] = [[] for _ in range(k)]
        done = torch.zeros(k, dtype=torch.bool)
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([x[n:]]).repeat(k, 1), past_key_values=c, use_cache=True).logits[:, -1]
            for _ in range(mnt):
                nt = torch.multinomial(torch.softmax(lg.float(), -1), 1, generator=gen).squeeze(1)
                for i in range(k):
                    if not done[i]:
                        out[i].append(int(nt[i]))
                done |= nt == eos
                if done.all():
                    break
                lg = model(input_ids=nt[:, None], past_key_values=c, use_cache=True).logits[:, -1]
        for o in out:
            txt = tok.decode(o, skip_special_tokens=True)
            res.append({"r": task.reward(txt, p.answer), "len": len(o), "ended": eos in o, "text": txt})
    print(json.dumps({"name": name, "shots": shots, "difficulty": diff, "n": len(res), "max_new_tokens": mnt,
                      "acc": sum(r["r"] for r in res) / len(res), "len": sum(r["len"] for r in res) / len(res),
                      "ended": sum(r["ended"] for r in res) / len(res), "prompt_tokens": sum(map(len, ids)) / len(ids),
                      "prefix": n, "seconds": time.time() - t0, "examples": [r["text"] for r in res[:3]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
