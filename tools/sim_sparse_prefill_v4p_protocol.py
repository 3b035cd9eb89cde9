"""Random-interleaving model of the opt-in sparse prefill v4p's barrier protocol
(src/sm90/sparse_prefill_kernel_v4.cuh; bench/NOTES.md "sparse prefill v4p", invariants J1-J6).
Usage: python3 tools/sim_sparse_prefill_v4p_protocol.py [seeds]   (MUT=noqwait|noqfree1|localph|nofree11
injects a known bug: each must report a VIOLATION, which shows the model can catch it).
A model, not the kernel: keep it in step with the kernel's waits / arrivals when either changes.
Actors: producer (one logical thread), WG0, WG1 (each one logical thread); async cp.async engine.
Checks: no deadlock, every wgmma/softmax read sees the expected data for its whole flight, no async
or generic write lands on data that an in-flight read still needs, every tile finishes."""
import random, sys, os
MUT=os.environ.get("MUT","")

class MBar:
    def __init__(s, count): s.count, s.pending, s.done = count, count, 0
    def arrive(s):
        s.pending -= 1
        assert s.pending >= 0
        if s.pending == 0: s.done += 1; s.pending = s.count
    def passed(s, parity): return (s.done & 1) != parity

class Named:
    def __init__(s): s.gen, s.arr = 0, 0
    def arrive(s):
        g = s.gen; s.arr += 1
        if s.arr == 2: s.gen += 1; s.arr = 0
        return g

class Viol(Exception): pass

def run(tiles, d576, seed):
    rnd = random.Random(seed)
    data, reads, pend = {}, {}, []   # subresource -> tag; subresource -> list of (who, tag); async queue
    seq = [0]
    full = {(s, p): MBar(2) for s in (0, 1) for p in (0, 1)}   # 1 noinc + 1 release (scaled)
    free = {(s, p): MBar(1) for s in (0, 1) for p in (0, 1)}   # one warpgroup (scaled)
    q_full, q_free = MBar(2), MBar(2)
    nb = {k: Named() for k in ("Scale0", "Scale1", "P0", "P1", "Cons")}
    def parts(s, p):
        if s == 0 and p == 0: return ["s0A_v"]
        if s == 0 and p == 1: return ["s0B_v"] + (["s0B_8"] if d576 else [])
        if s == 1 and p == 0: return ["s1A_v"] + (["s1A_8"] if d576 else [])
        return ["s1B_v"]
    def async_write(res, tag):
        seq[0] += 1; pend.append(("w", seq[0], res, tag))
    def async_noinc(bar):
        seq[0] += 1; pend.append(("a", seq[0], bar, None))
    def gen_write(res, tag, who):
        if reads.get(res): raise Viol(f"{who} writes {res} while read in flight by {reads[res]}")
        if any(e[0] == "w" and e[2] == res for e in pend): raise Viol(f"{who} writes {res} with a fill pending")
        data[res] = tag
    def rstart(res, tag, who):
        if data.get(res) != tag: raise Viol(f"{who} reads {res}: has {data.get(res)} want {tag}")
        reads.setdefault(res, []).append((who, tag))
    def rend(res, tag, who):
        if data.get(res) != tag: raise Viol(f"{who} read of {res} clobbered: {data.get(res)} want {tag}")
        reads[res].remove((who, tag))
    def wait_until(pred):
        while not pred(): yield

    def producer():
        u0 = u1 = uq = 0
        for t, n in enumerate(tiles):
            if n == 0: continue
            if uq > 0 and MUT != "noqwait": yield from wait_until(lambda: q_free.passed((uq - 1) & 1))
            async_write("Q", t); async_noinc(q_full); q_full.arrive(); uq += 1; yield
            j = 0
            while 2 * j < n:
                has1 = 2 * j + 1 < n
                def fill(s, p, blk):
                    for r in parts(s, p): async_write(r, (t, blk))
                    if p == 0: async_write(f"valid{s}", (t, blk))
                    async_noinc(full[(s, p)]); full[(s, p)].arrive()
                if u0 == 0:
                    fill(0, 0, 2 * j); yield; fill(0, 1, 2 * j); yield
                    if has1: fill(1, 0, 2 * j + 1); yield; fill(1, 1, 2 * j + 1); yield
                else:
                    yield from wait_until(lambda: free[(0, 0)].passed((u0 - 1) & 1)); fill(0, 0, 2 * j); yield
                    if has1:
                        if u1 > 0 and MUT != "nofree11": yield from wait_until(lambda: free[(1, 1)].passed((u1 - 1) & 1))
                        fill(1, 1, 2 * j + 1); yield
                    yield from wait_until(lambda: free[(0, 1)].passed((u0 - 1) & 1)); fill(0, 1, 2 * j); yield
                    if has1:
                        if u1 > 0: yield from wait_until(lambda: free[(1, 0)].passed((u1 - 1) & 1))
                        fill(1, 0, 2 * j + 1); yield
                u0 += 1
                if has1: u1 += 1
                j += 1

    def nsync(name):
        g = nb[name].arrive()
        yield from wait_until(lambda: nb[name].gen > g)

    done = {"wg0": [], "wg1": []}
    def consumer(wg):
        who = f"wg{wg}"; phs = 0
        for t, n in enumerate(tiles):
            phq = (phs >> 2) & 1
            j = 0
            while 2 * j < n:
                has1, last = 2 * j + 1 < n, 2 * j + 2 >= n
                ph0, ph1 = (phs & 1, (phs >> 1) & 1) if MUT != "localph" else (j & 1, j & 1)
                b0, b1 = (t, 2 * j), (t, 2 * j + 1)
                if wg == 0:
                    if j == 0: yield from wait_until(lambda: q_full.passed(phq))
                    yield from wait_until(lambda: full[(0, 0)].passed(ph0))
                    rstart("Q", t, who); rstart("s0A_v", b0, who); yield
                    yield from wait_until(lambda: full[(0, 1)].passed(ph0))
                    rstart("s0B_v", b0, who)
                    if d576: rstart("s0B_8", b0, who)
                    yield
                    rend("Q", t, who); rend("s0A_v", b0, who); rend("s0B_v", b0, who)
                    if d576: rend("s0B_8", b0, who)
                    if last: q_free.arrive()
                    rstart("valid0", b0, who); rend("valid0", b0, who)
                    nb["Scale0"].arrive(); yield
                    rstart("s0A_v", b0, who); yield          # P0 V0_L in flight
                    yield from nsync("Scale1")
                    gen_write("s0B_8", ("P0", t, j), who)     # P0 -> slab 8 of stage 0
                    nb["P0"].arrive(); yield
                    rend("s0A_v", b0, who); free[(0, 0)].arrive(); yield
                    yield from nsync("P1")
                    if has1:
                        yield from wait_until(lambda: full[(1, 0)].passed(ph1))
                        rstart("s1A_v", b1, who); rstart("s1A_8", ("P1", t, j), who); yield
                        rend("s1A_v", b1, who); rend("s1A_8", ("P1", t, j), who); free[(1, 0)].arrive(); yield
                else:
                    if has1:
                        if j == 0: yield from wait_until(lambda: q_full.passed(phq))
                        yield from wait_until(lambda: full[(1, 0)].passed(ph1))
                        rstart("Q", t, who); rstart("s1A_v", b1, who)
                        if d576: rstart("s1A_8", b1, who)
                        yield
                        yield from wait_until(lambda: full[(1, 1)].passed(ph1))
                        rstart("s1B_v", b1, who); yield
                        rend("Q", t, who); rend("s1A_v", b1, who); rend("s1B_v", b1, who)
                        if d576: rend("s1A_8", b1, who)
                    if last and (has1 or MUT != "noqfree1"): q_free.arrive()
                    if has1: rstart("valid1", b1, who); rend("valid1", b1, who)
                    yield from nsync("Scale0")
                    nb["Scale1"].arrive()
                    if has1: gen_write("s1A_8", ("P1", t, j), who)
                    nb["P1"].arrive(); yield
                    if has1: rstart("s1B_v", b1, who); yield
                    yield from nsync("P0")
                    yield from wait_until(lambda: full[(0, 1)].passed(ph0))
                    rstart("s0B_v", b0, who); rstart("s0B_8", ("P0", t, j), who); yield
                    if has1: rend("s1B_v", b1, who); free[(1, 1)].arrive(); yield
                    rend("s0B_v", b0, who); rend("s0B_8", ("P0", t, j), who); free[(0, 1)].arrive(); yield
                phs ^= 3 if has1 else 1
                j += 1
            if n > 0:
                phs ^= 4
                yield from nsync("Cons")
            done[who].append(t)

    actors = {"prod": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    finished = set()
    steps = 0
    while len(finished) < 3 or pend:
        steps += 1
        if steps > 200_000: raise Viol("too many steps")
        choices = [a for a in actors if a not in finished]
        landable = [e for e in pend if e[0] == "w" or not any(x[0] == "w" and x[1] < e[1] for x in pend)]
        opts = [("a", a) for a in choices] + [("p", e) for e in landable]
        kind, x = rnd.choice(opts)
        if kind == "p":
            pend.remove(x)
            if x[0] == "w":
                if reads.get(x[2]): raise Viol(f"fill lands on {x[2]} while read by {reads[x[2]]}")
                data[x[2]] = x[3]
            else:
                x[2].arrive()
            continue
        try:
            next(actors[x])
        except StopIteration:
            finished.add(x)
        # deadlock: every live actor blocked for a long time and nothing pending
        if not pend and steps % 5000 == 0:
            pass
    assert done["wg0"] == list(range(len(tiles))) and done["wg1"] == list(range(len(tiles)))
    return steps

if __name__ == "__main__":
    n_ok = 0
    for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 300):
        r = random.Random(seed)
        tiles = [r.choice([0, 1, 2, 3, 4, 5, 7, 8]) for _ in range(r.randint(1, 7))]
        for d576 in (False, True):
            try:
                run(tiles, d576, seed)
                n_ok += 1
            except Viol as e:
                print("VIOLATION seed", seed, "d576", d576, "tiles", tiles, ":", e); sys.exit(1)
    print("ok", n_ok)
