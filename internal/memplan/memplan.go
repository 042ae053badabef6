// Package memplan predicts the memory of a make_graphed_callables build
// before anything is captured: it replays the allocations one eager warmup
// iteration made (a Trace) through a model of the caching allocator
// (internal/allocsim), in the order and with the release points of the
// capture program (internal/lifetime), as the graph pool would see them.
//
// A capture allocates what the same eager step allocates: a forward's
// outputs and saved tensors and its transients, a backward's grads and
// transients (freeing the saved tensors autograd releases on the way). What
// the program adds is when retained blocks die: a forward's capture-time
// graph (its saved tensors not freed by its backward) at DropCapture, a
// pool buffer at its Release; outputs and grads without one stay for the
// graphs' lifetime.
package memplan

import (
	"fmt"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/gograph/gograph/internal/allocsim"
	"github.com/gograph/gograph/internal/lifetime"
)

// Event is one allocation (Bytes >= 0) or free (Free) of block ID during
// warmup op Step (-1: between ops).
type Event struct {
	Free  bool
	ID    int
	Bytes int64
	Step  int
}

// Step is one recorded warmup op.
type Step struct {
	Kind lifetime.OpKind // a warmup op: WarmForward, WarmBackward, WarmWGrad, DropWarm, DropInference or DropZeroGrads
	Pass int
}

// Trace is what one eager warmup iteration allocated, in order, and which
// blocks hold each pass's outputs and grads.
type Trace struct {
	Steps   []Step
	Events  []Event
	Outputs map[[2]int]int // (pass, output) -> block
	Grads   map[[2]int]int // (pass, static-surface index) -> block
	New     []int64        // buffers the build allocates outside the pool
	NoSeed  bool           // the build carves no seed (it did not record its warmup)
}

// ParseTrace parses a trace as Python sends it, one item per line:
//
//	step I K P       warmup op I is K (f b w x y g) of pass P
//	a ID BYTES I     block ID allocated during op I (-1: between ops)
//	r ID I           block ID freed during op I
//	out P K ID       output K of pass P is block ID
//	grad P J ID      the grad at static-surface index J of pass P is block ID
//	new BYTES        a buffer of BYTES the build allocates outside the pool
//	noseed           the build carves no seed segment (ChooseSeed keeps the unseeded pool)
func ParseTrace(s string, passes int) (*Trace, error) {
	tr := &Trace{Outputs: map[[2]int]int{}, Grads: map[[2]int]int{}}
	for n, line := range strings.Split(strings.TrimSpace(s), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if err := tr.parseLine(f, passes); err != nil {
			return nil, fmt.Errorf("trace line %d (%q): %w", n+1, line, err)
		}
	}
	return tr, nil
}

func (tr *Trace) parseLine(f []string, passes int) error {
	want, ok := map[string]int{"step": 4, "a": 4, "r": 3, "out": 4, "grad": 4, "new": 2, "noseed": 1}[f[0]]
	if !ok || len(f) != want {
		return fmt.Errorf(`want "step I K P", "a ID BYTES I", "r ID I", "out P K ID", "grad P J ID", "new BYTES" or "noseed"`)
	}
	if f[0] == "noseed" {
		tr.NoSeed = true
		return nil
	}
	if f[0] == "step" {
		i, err1 := strconv.Atoi(f[1])
		p, err2 := strconv.Atoi(f[3])
		if err1 != nil || err2 != nil || i != len(tr.Steps) || p < 0 || p >= passes || len(f[2]) != 1 || !strings.Contains("fbwxyg", f[2]) {
			return fmt.Errorf("step %d must be numbered %d, of kind f, b, w, x, y or g, for a pass in [0, %d)", i, len(tr.Steps), passes)
		}
		tr.Steps = append(tr.Steps, Step{Kind: lifetime.OpKind(f[2][0]), Pass: p})
		return nil
	}
	v := make([]int64, len(f)-1)
	for i, s := range f[1:] {
		x, err := strconv.ParseInt(s, 10, 64)
		if err != nil || x < -1 || x > 1<<50 {
			return fmt.Errorf("field %d (%q) is not a byte count or index", i+1, s)
		}
		v[i] = x
	}
	switch f[0] {
	case "new":
		if v[0] < 0 {
			return fmt.Errorf("a new buffer of %d bytes", v[0])
		}
		tr.New = append(tr.New, v[0])
	case "a":
		if v[0] < 0 || v[1] < 0 || v[2] >= int64(len(tr.Steps)) {
			return fmt.Errorf("allocation of block %d, %d bytes, in step %d (of %d)", v[0], v[1], v[2], len(tr.Steps))
		}
		tr.Events = append(tr.Events, Event{ID: int(v[0]), Bytes: v[1], Step: int(v[2])})
	case "r":
		if v[0] < 0 || v[1] >= int64(len(tr.Steps)) {
			return fmt.Errorf("free of block %d in step %d (of %d)", v[0], v[1], len(tr.Steps))
		}
		tr.Events = append(tr.Events, Event{Free: true, ID: int(v[0]), Step: int(v[1])})
	default:
		if v[0] < 0 || v[0] >= int64(passes) || v[1] < 0 || v[2] < 0 {
			return fmt.Errorf("pass %d (of %d), index %d, block %d", v[0], passes, v[1], v[2])
		}
		key := [2]int{int(v[0]), int(v[1])}
		if f[0] == "out" {
			tr.Outputs[key] = int(v[2])
		} else {
			tr.Grads[key] = int(v[2])
		}
	}
	return nil
}

// OpMemory is the pool after one capture op.
type OpMemory struct {
	Op                  lifetime.Op
	Reserved, Allocated int64
}

// Result is the prediction.
type Result struct {
	Seed              int64 // the segment carved before the captures (0: none)
	PoolReserved      int64 // the graph pool's segments once every capture is done
	PoolPeakAllocated int64 // the most its blocks held at once during the captures
	PoolLive          int64 // what its blocks hold after the build (static outputs, grads, ...)
	PoolSegments      int64
	WarmupReserved    int64 // segments one warmup iteration needs in a fresh pool
	WarmupAllocated   int64 // its peak allocated
	// Outside is what stays reserved beside the graph pool through the
	// captures, as segments of the default pool once its cache is emptied:
	// what warmup allocated and never freed (caches made on first use: the
	// cuBLAS workspaces of the captures' stream, one per handle) and the
	// build's new buffers (Trace.New).
	Outside    int64
	Ops        []OpMemory
	Unrecorded []int // passes with a captured graph but no recorded warmup step
	// Places of the blocks that hold outputs and grads (by the trace's
	// block id), when the capture allocated them: buffers at one place are
	// one storage, re-carved once the earlier one was released.
	Places   map[int][2]int64
	Segments []int64 // segment sizes, in creation order
}

// Simulate predicts the pool of prog from tr.
func Simulate(prog *lifetime.Program, tr *Trace) (*Result, error) {
	return SimulateSeeded(prog, tr, 0)
}

// SimulateSeeded predicts the pool of prog from tr when one segment of seed
// bytes (0: none) is allocated and freed in the pool before the first
// capture (allocsim.Pool.Seed).
func SimulateSeeded(prog *lifetime.Program, tr *Trace, seed int64) (*Result, error) {
	w, err := prepare(tr)
	if err != nil {
		return nil, err
	}
	return w.simulate(prog, seed)
}

// prepared is what every simulation of one trace shares, whatever the seed:
// the warmup's own figures and each recorded step's events.
type prepared struct {
	tr                              *Trace
	warmupReserved, warmupAllocated int64
	outside                         int64
	byStep                          map[Step][]Event
	first                           map[Step]int
	named                           map[int]bool // blocks that hold an output or a grad
}

func prepare(tr *Trace) (*prepared, error) {
	var res Result
	if err := warmup(tr, &res); err != nil {
		return nil, err
	}
	w := &prepared{tr: tr, warmupReserved: res.WarmupReserved, warmupAllocated: res.WarmupAllocated, outside: res.Outside,
		byStep: map[Step][]Event{}, first: map[Step]int{}, named: map[int]bool{}}
	for i, s := range tr.Steps {
		if _, ok := w.first[s]; !ok {
			w.first[s] = i
		}
	}
	for _, e := range tr.Events {
		if e.Step >= 0 && w.first[tr.Steps[e.Step]] == e.Step {
			s := tr.Steps[e.Step]
			w.byStep[s] = append(w.byStep[s], e)
		}
	}
	for _, id := range tr.Outputs {
		w.named[id] = true
	}
	for _, id := range tr.Grads {
		w.named[id] = true
	}
	return w, nil
}

// simulate runs the capture program over a fresh pool (seeded with one
// segment of seed bytes, 0: none); w is only read, so simulations of one
// trace may run at once.
func (w *prepared) simulate(prog *lifetime.Program, seed int64) (*Result, error) {
	res := &Result{Seed: seed, WarmupReserved: w.warmupReserved, WarmupAllocated: w.warmupAllocated, Outside: w.outside}
	sim := &capture{pool: allocsim.New(), tr: w.tr, forward: map[int][]int{}, byStep: w.byStep, first: w.first, named: w.named}
	if seed > 0 {
		if err := sim.pool.Seed(seed); err != nil {
			return nil, fmt.Errorf("seed segment: %w", err)
		}
	}
	res.Places = map[int][2]int64{}
	for _, op := range prog.Ops {
		if err := sim.run(op, res); err != nil {
			return nil, fmt.Errorf("capture op %s: %w", op, err)
		}
		res.Ops = append(res.Ops, OpMemory{Op: op, Reserved: sim.pool.Reserved(), Allocated: sim.pool.Allocated()})
	}
	res.PoolReserved, res.PoolPeakAllocated = sim.pool.Reserved(), sim.pool.PeakAllocated()
	res.PoolLive, res.PoolSegments = sim.pool.Allocated(), sim.pool.Segments()
	res.Segments = sim.pool.SegmentSizes()
	return res, nil
}

// warmup replays every event in a fresh pool: the warmup's own high-water.
func warmup(tr *Trace, res *Result) error {
	pool := allocsim.New()
	for _, e := range tr.Events {
		if e.Free {
			if pool.Live(e.ID) {
				_ = pool.Free(e.ID)
			}
			continue
		}
		if err := pool.Alloc(e.ID, e.Bytes); err != nil {
			return fmt.Errorf("warmup: %w", err)
		}
	}
	res.WarmupReserved, res.WarmupAllocated = pool.PeakReserved(), pool.PeakAllocated()
	outside := allocsim.New() // the blocks still live, alone: the segments empty_cache leaves
	for _, e := range tr.Events {
		if !e.Free && pool.Live(e.ID) {
			if err := outside.Alloc(e.ID, e.Bytes); err != nil {
				return fmt.Errorf("warmup's kept blocks: %w", err)
			}
		}
	}
	for i, n := range tr.New { // ids past every trace block's
		if err := outside.Alloc(-1-i, n); err != nil {
			return fmt.Errorf("new buffer %d: %w", i, err)
		}
	}
	res.Outside = outside.Reserved()
	return nil
}

type capture struct {
	pool    *allocsim.Pool
	tr      *Trace
	forward map[int][]int // pass -> blocks its forward capture allocated
	byStep  map[Step][]Event
	first   map[Step]int
	named   map[int]bool // blocks that hold an output or a grad
}

func (c *capture) run(op lifetime.Op, res *Result) error {
	switch op.Kind {
	case lifetime.CaptureForward:
		return c.replay(Step{lifetime.WarmForward, op.Pass}, op.Pass, res)
	case lifetime.CaptureBackward:
		return c.replay(Step{lifetime.WarmBackward, op.Pass}, -1, res)
	case lifetime.CaptureWGrad:
		return c.replay(Step{lifetime.WarmWGrad, op.Pass}, -1, res)
	case lifetime.DropCapture:
		// The capture-time graph dies: what the forward allocated and its
		// backward did not free, except the outputs the graphs keep.
		outs := map[int]bool{}
		for k, id := range c.tr.Outputs {
			if k[0] == op.Pass {
				outs[id] = true
			}
		}
		for _, id := range c.forward[op.Pass] {
			if !outs[id] && c.pool.Live(id) {
				_ = c.pool.Free(id)
			}
		}
		return nil
	case lifetime.ReturnWarmupPool:
		return nil // a pool reference: the model's pool has no reference count
	case lifetime.Release:
		key := [2]int{op.Pass, op.Index}
		id, ok := c.tr.Grads[key]
		if op.Role == lifetime.Output {
			id, ok = c.tr.Outputs[key]
		}
		if ok && c.pool.Live(id) {
			return c.pool.Free(id)
		}
		return nil
	}
	return fmt.Errorf("not a capture op")
}

// replay runs a warmup step's events in the pool; forward blocks are
// remembered under fwdPass (>= 0).
func (c *capture) replay(s Step, fwdPass int, res *Result) error {
	if _, ok := c.first[s]; !ok {
		res.Unrecorded = append(res.Unrecorded, s.Pass)
		return nil
	}
	for _, e := range c.byStep[s] {
		if e.Free {
			if c.pool.Live(e.ID) {
				if err := c.pool.Free(e.ID); err != nil {
					return err
				}
			}
			continue
		}
		if err := c.pool.Alloc(e.ID, e.Bytes); err != nil {
			return err
		}
		if c.named[e.ID] {
			seg, off, _ := c.pool.Where(e.ID)
			res.Places[e.ID] = [2]int64{seg, off}
		}
		if fwdPass >= 0 {
			c.forward[fwdPass] = append(c.forward[fwdPass], e.ID)
		}
	}
	return nil
}

// Encode renders r as Python reads it:
//
//	seed BYTES                      the segment carved before the captures (0: none)
//	pool RESERVED PEAK_ALLOCATED LIVE SEGMENTS
//	warmup RESERVED PEAK_ALLOCATED OUTSIDE
//	op OP... RESERVED ALLOCATED     after each capture op
//	unrecorded P                    a pass whose graph had no recorded warmup step
//	place ID SEGMENT OFFSET         where the capture put block ID (an output or a grad)
//	segments SIZE...                the pool's segments, in creation order
func (r *Result) Encode() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d\n", r.Seed)
	fmt.Fprintf(&b, "pool %d %d %d %d\n", r.PoolReserved, r.PoolPeakAllocated, r.PoolLive, r.PoolSegments)
	fmt.Fprintf(&b, "warmup %d %d %d\n", r.WarmupReserved, r.WarmupAllocated, r.Outside)
	for _, o := range r.Ops {
		fmt.Fprintf(&b, "op %s %d %d\n", o.Op, o.Reserved, o.Allocated)
	}
	for _, p := range r.Unrecorded {
		fmt.Fprintf(&b, "unrecorded %d\n", p)
	}
	ids := make([]int, 0, len(r.Places))
	for id := range r.Places {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	for _, id := range ids {
		fmt.Fprintf(&b, "place %d %d %d\n", id, r.Places[id][0], r.Places[id][1])
	}
	b.WriteString("segments")
	for _, s := range r.Segments {
		fmt.Fprintf(&b, " %d", s)
	}
	b.WriteString("\n")
	return b.String()
}

// seedSteps is how many seed sizes ChooseSeed tries between half the
// captures' peak and the peak.
const seedSteps = 128

// ChooseSeed returns the prediction with the seed segment that makes the
// smallest pool (Simulate's when no seed does better): the captures grow a
// pool a segment at a time, so it ends larger than the most its blocks hold
// at once, and one segment carved first lets freed neighbours merge. Seeds
// from half the unseeded peak to the peak are tried, in 2 MiB steps at
// least; a seed the captures do not fill is reserved all the same, so the
// search stays below the peak.
func ChooseSeed(prog *lifetime.Program, tr *Trace) (*Result, error) {
	w, err := prepare(tr)
	if err != nil {
		return nil, err
	}
	best, err := w.simulate(prog, 0)
	if err != nil {
		return nil, err
	}
	if tr.NoSeed {
		return best, nil
	}
	peak := best.PoolPeakAllocated
	// No pool is smaller than its peak allocated, in whole 2 MiB: a pool
	// there already has nothing to gain (most small builds), and no later
	// seed can do better once one reaches it.
	floor := allocsim.RoundLarge * ((peak + allocsim.RoundLarge - 1) / allocsim.RoundLarge)
	step := max(allocsim.RoundLarge, peak/2/seedSteps)
	var seeds []int64
	for seed := peak / 2; seed <= peak; seed += step {
		seeds = append(seeds, seed)
	}
	// The simulations are independent: a batch of them runs at once, one
	// per CPU, and the batch's results are taken in seed order up to where a
	// loop over the seeds would have stopped, so the choice is that loop's
	// on any machine (the first smallest before the pool reaches the floor).
	batch := max(1, runtime.GOMAXPROCS(0))
	for lo := 0; lo < len(seeds) && best.PoolReserved > floor; lo += batch {
		results, err := w.simulateAll(prog, seeds[lo:min(lo+batch, len(seeds))])
		if err != nil {
			return nil, err
		}
		for _, res := range results {
			if best.PoolReserved <= floor {
				break
			}
			if res.PoolReserved < best.PoolReserved {
				best = res
			}
		}
	}
	return best, nil
}

// simulateAll simulates each seed at once; the results are in seeds' order,
// the error is the first seed's that failed.
func (w *prepared) simulateAll(prog *lifetime.Program, seeds []int64) ([]*Result, error) {
	results := make([]*Result, len(seeds))
	errs := make([]error, len(seeds))
	var wg sync.WaitGroup
	for i, seed := range seeds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = w.simulate(prog, seed)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return results, nil
}
