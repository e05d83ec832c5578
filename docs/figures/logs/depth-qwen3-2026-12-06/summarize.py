"""The Qwen3-0.6B depth run (run.sh): min / median / max per column and the per-round ratios, as markdown."""
import glob, json, statistics as st, sys
D = sys.argv[1] if len(sys.argv) > 1 else "."
R = sorted({int(p.split('-r')[-1].split('.')[0]) for p in glob.glob(f'{D}/llama-prefill-r*.jsonl')})
def mmm(xs): return f"{min(xs):.1f} / {st.median(xs):.1f} / {max(xs):.1f}"
def rat(xs): return f"{st.median(xs):.2f}x [{min(xs):.2f}, {max(xs):.2f}]"
ours = {kv: [json.load(open(f'{D}/ours-{kv}-r{r}.json')) for r in R] for kv in ('fp32', 'int8')}
llama = {}
for kind in ('decode', 'prefill'):
    for r in R:
        for l in open(f'{D}/llama-{kind}-r{r}.jsonl'):
            d = json.loads(l)
            key = (kind, d['n_depth'] if kind == 'decode' else d['n_prompt'], 'on' if d['flash_attn'] else 'off')
            llama.setdefault(key, []).append(d['avg_ts'])
print(f"rounds {R}\n")
print("| depth | ours fp32 cache | ours int8 cache | llama.cpp fa on | llama.cpp fa off | fp32 / llama.cpp (faster) | int8 / llama.cpp (faster) |")
print("|---|---|---|---|---|---|---|")
for dep in ('0', '1024', '4096', '8192'):
    o32 = [x['depths'][dep]['tokens_per_s'] for x in ours['fp32']]
    o8 = [x['depths'][dep]['tokens_per_s'] for x in ours['int8']]
    on, off = llama[('decode', int(dep), 'on')], llama[('decode', int(dep), 'off')]
    best = [max(c, d) for c, d in zip(on, off)]
    print(f"| {dep} | {mmm(o32)} | {mmm(o8)} | {mmm(on)} | {mmm(off)} | {rat([a / b for a, b in zip(o32, best)])} | "
          f"{rat([a / b for a, b in zip(o8, best)])} |")
print()
print("| prompt tokens | ours fp32 cache | ours int8 cache | llama.cpp fa on | llama.cpp fa off | fp32 / llama.cpp (faster) | int8 / llama.cpp (faster) |")
print("|---|---|---|---|---|---|---|")
for p in ('128', '1024'):
    o32 = [x['prefills'][p]['tokens_per_s'] for x in ours['fp32']]
    o8 = [x['prefills'][p]['tokens_per_s'] for x in ours['int8']]
    on, off = llama[('prefill', int(p), 'on')], llama[('prefill', int(p), 'off')]
    best = [max(c, d) for c, d in zip(on, off)]
    print(f"| {p} | {mmm(o32)} | {mmm(o8)} | {mmm(on)} | {mmm(off)} | {rat([a / b for a, b in zip(o32, best)])} | "
          f"{rat([a / b for a, b in zip(o8, best)])} |")
print()
print("| depth (prefill before the steps) | ours fp32 cache s | ours int8 cache s |")
print("|---|---|---|")
for dep in ('1024', '4096', '8192'):
    print(f"| {dep} | {mmm([x['depths'][dep]['prefill_s'] for x in ours['fp32']])} | "
          f"{mmm([x['depths'][dep]['prefill_s'] for x in ours['int8']])} |")
