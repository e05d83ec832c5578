import json, statistics as st, glob
R = sorted({int(p.split('-r')[-1].split('.')[0]) for p in glob.glob('docs/figures/logs/depth-2026-12-06/ours-fp32-r*.json')})
def mmm(xs): return f"{min(xs):.1f} / {st.median(xs):.1f} / {max(xs):.1f}"
ours = {kv: [json.load(open(f'docs/figures/logs/depth-2026-12-06/ours-{kv}-r{r}.json')) for r in R] for kv in ('fp32', 'fp16')}
llama = {}
for kind in ('decode', 'prefill'):
    for r in R:
        for l in open(f'docs/figures/logs/depth-2026-12-06/llama-{kind}-r{r}.jsonl'):
            d = json.loads(l)
            key = (kind, d['n_depth'] if kind == 'decode' else d['n_prompt'], 'on' if d['flash_attn'] else 'off')
            llama.setdefault(key, []).append(d['avg_ts'])
print(f"rounds {R}")
print("| depth | ours fp32 cache | ours fp16 cache | llama.cpp fa on | llama.cpp fa off | ours (better cache) / llama.cpp (faster), per round: median [min, max] |")
print("|---|---|---|---|---|---|")
for dep in ('0', '1024', '4096'):
    o32 = [x['depths'][dep]['tokens_per_s'] for x in ours['fp32']]
    o16 = [x['depths'][dep]['tokens_per_s'] for x in ours['fp16']]
    on, off = llama[('decode', int(dep), 'on')], llama[('decode', int(dep), 'off')]
    ratios = [max(a, b) / max(c, d) for a, b, c, d in zip(o32, o16, on, off)]
    r32 = [a / max(c, d) for a, c, d in zip(o32, on, off)]
    print(f"| {dep} | {mmm(o32)} | {mmm(o16)} | {mmm(on)} | {mmm(off)} | {st.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] (fp32 cache alone {st.median(r32):.2f}x) |")
print()
print("| prompt tokens | ours fp32 cache | ours fp16 cache | llama.cpp fa on | llama.cpp fa off | ours fp32 / llama.cpp (faster), per round |")
print("|---|---|---|---|---|---|")
for p in ('128', '1024'):
    o32 = [x['prefills'][p]['tokens_per_s'] for x in ours['fp32']]
    o16 = [x['prefills'][p]['tokens_per_s'] for x in ours['fp16']]
    on, off = llama[('prefill', int(p), 'on')], llama[('prefill', int(p), 'off')]
    ratios = [a / max(c, d) for a, c, d in zip(o32, on, off)]
    print(f"| {p} | {mmm(o32)} | {mmm(o16)} | {mmm(on)} | {mmm(off)} | {st.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] |")
