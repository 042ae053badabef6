// Package poolsim runs the allocations of a whole training run -- the build
// (warmup, captures) and its steps -- through PyTorch's caching allocator as
// internal/allocsim models it, with each allocation in the pool it would
// take on CUDA, and reports what the pools reserve together: the footprint
// bench's number (peak reserved bytes) computed on any machine.
//
// Three pools, as torch's allocator keeps them apart: the default pool on
// the default stream (the caller's tensors, owned grad copies, incoming
// grads), the default pool on the side stream that warmup runs on (its free
// blocks serve that stream only), and the graph pool the captures allocate
// in. Segments are never released, except the free ones of the two default
// pools at an empty_cache event (Python's engine calls it once, after the
// whole-step probe).
//
// The trace, after its header (wire.Pools), one event per line:
//
//	a ID BYTES POOL     allocation ID of BYTES in POOL (d, w or g)
//	f ID                allocation ID is freed
//	e                   empty_cache: the default pools give back free segments
//
// The result (wire.Footprint): "peak_reserved N", "peak_allocated N", and
// per pool "pool P reserved N peak_reserved N peak_allocated N segments N".
package poolsim

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/gograph/gograph/internal/allocsim"
)

// Pools names the three pools, in the order results list them.
var Pools = []string{"d", "w", "g"}

// Result is what the pools reserved: together at their peak, and each.
type Result struct {
	PeakReserved, PeakAllocated int64
	Pool                        map[string]PoolResult
}

// PoolResult is one pool's figures at the end of the trace and at its peaks.
type PoolResult struct {
	Reserved, PeakReserved, PeakAllocated, Segments int64
}

// Simulate runs the events of body (the trace without its header).
func Simulate(body string) (Result, error) {
	pools := map[string]*allocsim.Pool{}
	for _, p := range Pools {
		pools[p] = allocsim.New()
	}
	where := map[int]string{}
	var res Result
	for n, line := range strings.Split(body, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if err := apply(f, pools, where); err != nil {
			return Result{}, fmt.Errorf("poolsim: line %d %q: %w", n+1, clip(line), err)
		}
		var reserved, allocated int64
		for _, p := range pools {
			reserved += p.Reserved()
			allocated += p.Allocated()
		}
		res.PeakReserved = max(res.PeakReserved, reserved)
		res.PeakAllocated = max(res.PeakAllocated, allocated)
	}
	res.Pool = map[string]PoolResult{}
	for name, p := range pools {
		res.Pool[name] = PoolResult{p.Reserved(), p.PeakReserved(), p.PeakAllocated(), p.Segments()}
	}
	return res, nil
}

func apply(f []string, pools map[string]*allocsim.Pool, where map[int]string) error {
	switch {
	case f[0] == "a" && len(f) == 4:
		id, err := strconv.Atoi(f[1])
		if err != nil || id < 0 {
			return fmt.Errorf("bad allocation id %q", f[1])
		}
		n, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil || n < 0 || n > 1<<50 {
			return fmt.Errorf("bad size %q", f[2])
		}
		p, ok := pools[f[3]]
		if !ok {
			return fmt.Errorf("unknown pool %q (d, w or g)", f[3])
		}
		if err := p.Alloc(id, n); err != nil {
			return err
		}
		where[id] = f[3]
		return nil
	case f[0] == "f" && len(f) == 2:
		id, err := strconv.Atoi(f[1])
		if err != nil {
			return fmt.Errorf("bad allocation id %q", f[1])
		}
		pool, ok := where[id]
		if !ok {
			return fmt.Errorf("free of allocation %d, which is not live", id)
		}
		delete(where, id)
		return pools[pool].Free(id)
	case f[0] == "e" && len(f) == 1:
		pools["d"].ReleaseCached()
		pools["w"].ReleaseCached()
		return nil
	}
	return fmt.Errorf("not an event (a ID BYTES POOL, f ID or e)")
}

// Encode writes r as the result's lines.
func (r Result) Encode() string {
	var b strings.Builder
	fmt.Fprintf(&b, "peak_reserved %d\npeak_allocated %d\n", r.PeakReserved, r.PeakAllocated)
	for _, name := range Pools {
		p := r.Pool[name]
		fmt.Fprintf(&b, "pool %s reserved %d peak_reserved %d peak_allocated %d segments %d\n", name, p.Reserved, p.PeakReserved, p.PeakAllocated, p.Segments)
	}
	return b.String()
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}
