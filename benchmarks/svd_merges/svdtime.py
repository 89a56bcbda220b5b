import time, torch, json, sys
torch.set_num_threads(int(sys.argv[1]))
res = {}
for shape, dt in (((576, 576), torch.float32), ((1536, 576), torch.float32), ((192, 576), torch.float32), ((49152, 576), torch.float32), ((1536, 576), torch.float64)):
    x = torch.randn(*shape, dtype=dt)
    torch.linalg.svd(x, full_matrices=False)
    n = 3 if shape[0] < 10000 else 1
    t = time.perf_counter()
    for _ in range(n): torch.linalg.svd(x, full_matrices=False)
    s = (time.perf_counter() - t) / n
    m, k = max(shape), min(shape)
    res[f"{shape[0]}x{shape[1]} {str(dt)[6:]}"] = {"s": round(s, 4), "mnr_per_s": round(m * k * k / s / 1e9, 3)}
print(json.dumps(res, indent=1))
