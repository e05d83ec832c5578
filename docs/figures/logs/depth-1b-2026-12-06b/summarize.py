"""The Llama-3.2-1B depth run (int8 cache rewritten by rewrite_int8.py) (run.sh): ours int8 against llama.cpp, per round, as markdown."""
import glob, json, statistics as st, sys
D = sys.argv[1] if len(sys.argv) > 1 else "."
R = sorted({int(p.split('-r')[-1].split('.')[0]) for p in glob.glob(f'{D}/llama-prefill-r*.jsonl')})
def mmm(xs): return f"{min(xs):.1f} / {st.median(xs):.1f} / {max(xs):.1f}"
def rat(xs): return f"{st.median(xs):.2f}x [{min(xs):.2f}, {max(xs):.2f}]"
ours = [json.load(open(f'{D}/ours-int8-r{r}.json')) for r in R]
llama = {}
for kind in ('decode', 'prefill'):
    for r in R:
        for l in open(f'{D}/llama-{kind}-r{r}.jsonl'):
            d = json.loads(l)
            key = (kind, d['n_depth'] if kind == 'decode' else d['n_prompt'], 'on' if d['flash_attn'] else 'off')
            llama.setdefault(key, []).append(d['avg_ts'])
print(f"rounds {R}\n")
print("| depth | ours int8 cache | llama.cpp fa on | llama.cpp fa off | ours / llama.cpp (faster), per round |")
print("|---|---|---|---|---|")
for dep in ('0', '1024', '4096', '8192'):
    o8 = [x['depths'][dep]['tokens_per_s'] for x in ours]
    on, off = llama[('decode', int(dep), 'on')], llama[('decode', int(dep), 'off')]
    best = [max(c, d) for c, d in zip(on, off)]
    print(f"| {dep} | {mmm(o8)} | {mmm(on)} | {mmm(off)} | {rat([a / b for a, b in zip(o8, best)])} |")
print()
print("| prompt tokens | ours int8 cache | llama.cpp fa on | llama.cpp fa off | ours / llama.cpp (faster), per round |")
print("|---|---|---|---|---|")
for p in ('1024',):
    o8 = [x['prefills'][p]['tokens_per_s'] for x in ours]
    on, off = llama[('prefill', int(p), 'on')], llama[('prefill', int(p), 'off')]
    best = [max(c, d) for c, d in zip(on, off)]
    print(f"| {p} | {mmm(o8)} | {mmm(on)} | {mmm(off)} | {rat([a / b for a, b in zip(o8, best)])} |")
print()
print("| depth (the prefill before the steps) | ours int8 cache s |")
print("|---|---|")
for dep in ('1024', '4096', '8192'):
    print(f"| {dep} | {mmm([x['depths'][dep]['prefill_s'] for x in ours])} |")
