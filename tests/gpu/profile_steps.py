import random, sys, time, torch
from atom import LLMEngine, SamplingParams
from atom.benchmarks.model_configs import model_dir
m = sys.argv[1]
llm = LLMEngine(model_dir(m), load_dummy=True, skip_tokenizer_init=True, max_model_len=4096)
random.seed(0)
prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024)) for _ in range(256)]
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
# time split: prefill steps vs decode steps
ids = llm.add_request(prompts, params)
t_pref = t_dec = 0.0; n_pref = n_dec = 0
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
step = 0
while not llm.is_finished():
    batch_has_prefill = any(s.num_tokens - s.num_computed_tokens > 1 for s in llm.core.scheduler.running) or bool(llm.core.scheduler.waiting)
    if step == 300: prof.start()
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.step()
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    if step == 340: prof.stop()
    if batch_has_prefill: t_pref += dt; n_pref += 1
    else: t_dec += dt; n_dec += 1
    step += 1
print(f"{m}: prefill-ish steps {n_pref} {t_pref:.2f}s; decode steps {n_dec} {t_dec:.2f}s ({1000*t_dec/max(n_dec,1):.2f} ms/step)")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
