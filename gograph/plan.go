package gograph

// Planning: TransformerEngine's pipeline schedule (_order) or the default
// one, and the build's warmup and capture programs with every release
// point and buffer decision (internal/lifetime). A plan stays in Go behind a
// handle from PlanSchedule to FreePlan; Python reads what it executes, once
// per make_graphed_callables. Formats are in docs/CORE_API.md. Validation
// errors contain "invalid schedule:", which Python raises as ValueError.

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/gograph/gograph/internal/lifetime"
	"github.com/gograph/gograph/internal/memplan"
	"github.com/gograph/gograph/internal/poolsim"
	"github.com/gograph/gograph/internal/schedule"
	"github.com/gograph/gograph/internal/wire"
)

// PlanSchedule validates a schedule, expands it into warmup/capture steps
// and returns the plan's handle.
//
// order is _order with its entries joined by commas ("1,2,-2,-1.5"), or ""
// for the default schedule (forwards 0..n-1, then, when training, backwards
// n-1..0). layers is _num_layers_per_chunk: "" when not given, "*L" for one
// integer, or "L1,L2,...". numCallables and numSamples are len(callables)
// and len(sample_args); training says whether backward steps run;
// warmupIters is num_warmup_iters.
func PlanSchedule(order, layers string, numCallables, numSamples int, training bool, warmupIters int) (plan int64, err error) {
	defer recoverPanic("plan_schedule", &err)
	p, err := buildSchedule(order, layers, numCallables, numSamples, training, warmupIters)
	if err != nil {
		return 0, fmt.Errorf("plan_schedule: %w", err)
	}
	return store.Put(p), nil
}

func buildSchedule(order, layers string, numCallables, numSamples int, training bool, warmupIters int) (*schedule.Plan, error) {
	if order == "" {
		if layers != "" {
			return nil, fmt.Errorf("%w: _num_layers_per_chunk needs _order", schedule.ErrInvalid)
		}
		if numSamples != numCallables {
			return nil, fmt.Errorf("%w: expected sample_args to have the same length as callables, but got %d sample_args for %d callables", schedule.ErrInvalid, numSamples, numCallables)
		}
		return schedule.Default(numCallables, training)
	}
	entries, err := schedule.ParseOrder(order)
	if err != nil {
		return nil, err
	}
	spec := schedule.Spec{Order: entries, NumCallables: numCallables, NumSamples: numSamples, Training: training, WarmupIters: warmupIters}
	spec.Layers, spec.LayersScalar, err = schedule.ParseLayers(layers)
	if err != nil {
		return nil, err
	}
	return schedule.Build(spec)
}

// PlanSteps returns plan's steps: a header line, then "K pass callable
// entry chunk layer micro" per step (K one of F, B, W).
func PlanSteps(plan int64) (steps string, err error) {
	defer recoverPanic("plan_steps", &err)
	p, err := store.Get(plan)
	if err != nil {
		return "", fmt.Errorf("plan_steps: %w", err)
	}
	return p.Encode(), nil
}

// PlanSampleEntries is TransformerEngine's reorganisation of an _order's
// sample entries for _reuse_graph_input_output_buffers
// (lifetime.ReuseSampleEntries): keys gives each pass's sample key as an
// integer ("0,1,0,..."), chain says whether chain_buffers is on (a chunk's
// later layers take their microbatch's first entry), and the result gives,
// per pass, the pass whose entry it takes (its own when none),
// comma-separated, a "c" after an entry taken by chaining (the pass's sample
// args take it, its keyword args stay its own).
func PlanSampleEntries(plan int64, keys string, chain bool) (entries string, err error) {
	defer recoverPanic("plan_sample_entries", &err)
	p, err := store.Get(plan)
	if err != nil {
		return "", fmt.Errorf("plan_sample_entries: %w", err)
	}
	k, err := parseInts(keys)
	if err != nil {
		return "", fmt.Errorf("plan_sample_entries: keys: %w", err)
	}
	e, chained, err := lifetime.ReuseSampleEntries(p, k, chain)
	if err != nil {
		return "", fmt.Errorf("plan_sample_entries: %w", err)
	}
	parts := make([]string, len(e))
	for i, x := range e {
		parts[i] = strconv.Itoa(x)
		if chained[i] {
			parts[i] += "c"
		}
	}
	return strings.Join(parts, ","), nil
}

// PlanWarmup returns plan's warmup program for iters iterations: a header
// "warmup v1 pool=1" when warmup allocates in the build's graph pool
// ("pool=0" otherwise), then one "op K pass" line per op (f forward, b
// backward, w weight gradient, x the pass's warmup outputs die, y they die
// if none requires grad, g its zero incoming grads die). The default
// schedule warms up per callable (torch's loop) unless capture-time hooks
// are given, which need the schedule's order (TransformerEngine's), or the
// callables make the whole training step (wholeStep) and the pool is the
// build's own (ownPool): then in the schedule's order, in the graph pool
// (lifetime.ChooseWarmup says why). Zero incoming grads serve one pass's
// consecutive iterations unless hooks could write them (lifetime.ZeroGrads).
func PlanWarmup(plan int64, iters int, hooks, wholeStep, ownPool bool) (program string, err error) {
	defer recoverPanic("plan_warmup", &err)
	p, err := store.Get(plan)
	if err != nil {
		return "", fmt.Errorf("plan_warmup: %w", err)
	}
	if iters < 0 {
		return "", fmt.Errorf("plan_warmup: %d iterations", iters)
	}
	mode := lifetime.ChooseWarmup(p, hooks, wholeStep, ownPool)
	pool := "pool=0"
	if mode.InPool {
		pool = "pool=1"
	}
	ops := lifetime.ZeroGrads(lifetime.Warmup(p, iters, mode.PerCallable), !hooks)
	return wire.Warmup.Header(pool) + lifetime.EncodeOps(ops), nil
}

// PlanCapture returns plan's capture program from what warmup learned
// (facts: a "facts v1" header, then lifetime.ParseFacts's lines): a
// "program v1" header, then the capture ops with every release point, where
// each static buffer comes from, how each parameter grad reaches .grad and
// which lent grads each graph may overwrite (lifetime.Program.Encode's
// format). reuse shares static buffers by liveness, chain chains
// consecutive layers' buffers, release hands dead pool buffers back to the
// pool (an engine with device pools). The program stays with the plan
// (PlanMemory reads it).
func PlanCapture(plan int64, facts string, reuse, chain, release, share bool) (program string, err error) {
	defer recoverPanic("plan_capture", &err)
	prog, err := captureProgram(plan, facts, lifetime.Options{Reuse: reuse, Chain: chain, Release: release, Share: share})
	if err != nil {
		return "", fmt.Errorf("plan_capture: %w", err)
	}
	if err := store.SetProgram(plan, prog); err != nil {
		return "", fmt.Errorf("plan_capture: %w", err)
	}
	return wire.Program.Header() + prog.Encode(), nil
}

// captureProgram plans the captures of plan from facts.
func captureProgram(plan int64, facts string, opt lifetime.Options) (*lifetime.Program, error) {
	p, err := store.Get(plan)
	if err != nil {
		return nil, err
	}
	_, body, err := wire.Facts.Body(facts)
	if err != nil {
		return nil, err
	}
	f, err := lifetime.ParseFacts(body, p.Passes)
	if err != nil {
		return nil, err
	}
	return lifetime.Capture(p, f, opt)
}

// FreePlan forgets plan; it reports whether the handle was known (freeing
// twice is harmless).
func FreePlan(plan int64) (known bool, err error) {
	defer recoverPanic("free_plan", &err)
	return store.Free(plan), nil
}

// LivePlans returns how many plans are held (leak checks: a build frees its
// plan when it ends, failed or not).
func LivePlans() int { return store.Live() }

// PlanMemory predicts the memory of plan's build before anything is
// captured: the capture program PlanCapture planned for it, run over what
// one eager warmup iteration allocated (trace: a "trace v1" header, then
// memplan.ParseTrace's lines) through a model of the caching allocator. It
// returns a "prediction v1" header, then memplan.Result.Encode's text: the
// seed segment the build carves before its captures (memplan.ChooseSeed; 0
// when none makes the pool smaller), the pool's reserved bytes, peak and
// live allocation and segments, the warmup's own peak, and the pool after
// each capture op.
func PlanMemory(plan int64, trace string) (prediction string, err error) {
	defer recoverPanic("plan_memory", &err)
	p, prog, err := store.Program(plan)
	if err != nil {
		return "", fmt.Errorf("plan_memory: %w", err)
	}
	_, body, err := wire.Trace.Body(trace)
	if err != nil {
		return "", fmt.Errorf("plan_memory: %w", err)
	}
	tr, err := memplan.ParseTrace(body, p.Passes)
	if err != nil {
		return "", fmt.Errorf("plan_memory: %w", err)
	}
	res, err := memplan.ChooseSeed(prog, tr)
	if err != nil {
		return "", fmt.Errorf("plan_memory: %w", err)
	}
	return wire.Prediction.Header() + res.Encode(), nil
}

// SimulatePools runs a training run's allocations (header "pools v1", then
// the events of internal/poolsim) through the caching-allocator model, each
// in its pool, and returns what the pools reserve (header "footprint v1"):
// the footprint bench's peak reserved bytes, computed without a GPU.
func SimulatePools(trace string) (footprint string, err error) {
	defer recoverPanic("simulate_pools", &err)
	_, body, err := wire.Pools.Body(trace)
	if err != nil {
		return "", fmt.Errorf("simulate_pools: %w", err)
	}
	res, err := poolsim.Simulate(body)
	if err != nil {
		return "", fmt.Errorf("simulate_pools: %w", err)
	}
	return wire.Footprint.Header() + res.Encode(), nil
}

// parseInts parses comma-separated integers ("" is none).
func parseInts(s string) ([]int, error) {
	if s == "" {
		return nil, nil
	}
	fields := strings.Split(s, ",")
	out := make([]int, len(fields))
	for i, f := range fields {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("item %d (%q) is not an integer", i, f)
		}
		out[i] = n
	}
	return out, nil
}
