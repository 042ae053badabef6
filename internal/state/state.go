// Package state keeps gograph's pass records: one record per graphed
// callable, holding the graphs it owns by kind, the memory-pool references it
// took, and its lifecycle building -> ready -> reset.
//
// This is the state TransformerEngine keeps in Python closures, made explicit
// so that lifetimes are data: a record references only its own graphs,
// resetting it releases exactly what it owns, a second reset is harmless,
// and a reset record refuses to replay with an error that says why, instead
// of launching a destroyed graph.
//
// The package does no CUDA itself; it frees and launches graphs through the
// Graphs interface (the cudagraph registry in the product, a fake in tests).
package state

import (
	"fmt"
	"sync"
)

// GraphKind is what a graph of a pass computes.
type GraphKind int

// Graph kinds.
const (
	Forward  GraphKind = 0
	Backward GraphKind = 1
	WGrad    GraphKind = 2 // delayed weight gradient (TransformerEngine's backward_dw)

	NumKinds = 3
)

func (k GraphKind) valid() bool { return k >= 0 && k < NumKinds }

func (k GraphKind) String() string {
	switch k {
	case Forward:
		return "forward"
	case Backward:
		return "backward"
	case WGrad:
		return "wgrad"
	}
	return fmt.Sprintf("GraphKind(%d)", int(k))
}

func checkKind(k GraphKind) error {
	if !k.valid() {
		return fmt.Errorf("unknown graph kind %d (want 0 forward, 1 backward or 2 wgrad)", int(k))
	}
	return nil
}

// Lifecycle is where a pass stands.
type Lifecycle int

// Lifecycle states, in the only order a pass moves through them (a pass can
// also go from Building straight to Reset when its capture fails).
const (
	Building Lifecycle = iota // graphs are being captured and attached
	Ready                     // sealed: replays are allowed
	Reset                     // graphs destroyed: replays are refused forever
)

func (l Lifecycle) String() string {
	switch l {
	case Building:
		return "building"
	case Ready:
		return "ready"
	case Reset:
		return "reset"
	}
	return fmt.Sprintf("Lifecycle(%d)", int(l))
}

// Graphs captures, launches and frees graphs by handle; the cudagraph registry
// satisfies it (its methods are the capture engine's). Handle 0 never
// reaches it: it stands for "nothing to launch", and stream 0 for "nothing to
// capture" (the eager engine), so neither is ever passed down.
type Graphs interface {
	BeginCapture(stream int64, mode int) error
	EndCapture(stream int64) (graph int64, err error)
	AbortCapture(stream int64) error
	Launch(graph, stream int64) error
	Order(graph, stream int64) error
	Destroy(graph int64) error
}

// Pass is one graphed callable's record, as Ledger.Snapshot copies it out.
type Pass struct {
	ID            int64
	CallableIndex int
	Label         string
	Graphs        [NumKinds]int64 // graph handle by GraphKind; 0 = none or eager
	Has           [NumKinds]bool  // whether a kind was attached (even with handle 0)
	PoolRefs      int             // memory-pool references taken and not yet handed back
	Lifecycle     Lifecycle
	Pool          string        // key of the pool its captures were recorded in (order.go)
	Seq           [NumKinds]int // capture sequence number in Pool by GraphKind; 0 = not recorded
	CheckOrder    bool          // the replay-order guard is on (order.go)
	ResetErr      string        // why the last reset failed to destroy a graph ("" none)
}

// record is a Pass in the ledger, with the lock that guards it.
type record struct {
	mu sync.Mutex
	Pass
	order  *poolOrder          // capture order of Pool; nil until a capture begins
	chain  [NumKinds]GraphKind // recorded kinds in capture order (order.go)
	nchain int
	open   openCapture // the capture underway (capture.go)
}

func (p *Pass) errReset() error {
	return fmt.Errorf("graphed callable %d (%q) was reset; call make_graphed_callables again to graph it anew", p.CallableIndex, p.Label)
}

// Ledger holds the pass records by id (from 1, never reused) and counts the
// memory-pool references they hold, per pool. It is safe for concurrent use:
// the ledger's lock guards only its maps, and each record has its own lock,
// so replays of different passes never wait on each other while a replay and
// a reset of the same pass are strictly ordered. Lock order is record, then
// ledger, then pool.
type Ledger struct {
	graphs Graphs

	mu       sync.Mutex
	passes   map[int64]*record
	owner    map[int64]int64 // graph handle -> id of the pass that owns it
	next     int64
	pools    map[string]*poolOrder // capture order by pool key (order.go)
	poolRefs map[string]int        // pool references held by live records, by pool key
}

// NewLedger returns an empty ledger that frees and launches through g.
func NewLedger(g Graphs) *Ledger {
	return &Ledger{
		graphs:   recoverGraphs(g), // a panic in g comes back as its call's error (recover.go)
		passes:   make(map[int64]*record),
		owner:    make(map[int64]int64),
		next:     1,
		pools:    make(map[string]*poolOrder),
		poolRefs: make(map[string]int),
	}
}

// lock finds pass id and returns it locked.
func (l *Ledger) lock(id int64) (*record, error) {
	l.mu.Lock()
	p := l.passes[id]
	l.mu.Unlock()
	if p == nil {
		return nil, fmt.Errorf("unknown pass %d", id)
	}
	p.mu.Lock()
	return p, nil
}

// lockKind is lock for a call about one kind of graph: an unknown kind is
// refused before any record is locked.
func (l *Ledger) lockKind(id int64, kind GraphKind) (*record, error) {
	if err := checkKind(kind); err != nil {
		return nil, err
	}
	return l.lock(id)
}

// NewPass creates a record in state Building for the callable at
// callableIndex (its position in make_graphed_callables' tuple) and returns
// its id. label names the callable in errors.
func (l *Ledger) NewPass(callableIndex int, label string) (int64, error) {
	if callableIndex < 0 {
		return 0, fmt.Errorf("callable index %d is negative", callableIndex)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	id := l.next
	l.next++
	l.passes[id] = &record{Pass: Pass{ID: id, CallableIndex: callableIndex, Label: label}}
	return id, nil
}

// Seal moves pass id from Building to Ready.
func (l *Ledger) Seal(id int64) error {
	p, err := l.lock(id)
	if err != nil {
		return err
	}
	defer p.mu.Unlock()
	switch {
	case p.Lifecycle == Reset:
		return p.errReset()
	case p.Lifecycle == Ready:
		return fmt.Errorf("graphed callable %d (%q) is already sealed", p.CallableIndex, p.Label)
	case p.open.active:
		return fmt.Errorf("graphed callable %d (%q): its %s capture is still open; end or abort it before sealing", p.CallableIndex, p.Label, p.open.kind)
	}
	p.Lifecycle = Ready
	return nil
}

// Replay launches pass id's graph of kind on stream: the hot path. The pass
// must be Ready and have the kind; a handle of 0 launches nothing. It reports
// whether a graph was launched. The record stays locked across the launch so
// a concurrent reset cannot destroy the graph underneath it.
func (l *Ledger) Replay(id int64, kind GraphKind, stream int64) (bool, error) {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return false, err
	}
	defer p.mu.Unlock()
	switch {
	case p.Lifecycle == Reset:
		return false, p.errReset()
	case p.Lifecycle == Building:
		return false, fmt.Errorf("graphed callable %d (%q) is still being captured", p.CallableIndex, p.Label)
	case !p.Has[kind]:
		return false, fmt.Errorf("graphed callable %d (%q) has no %s graph", p.CallableIndex, p.Label, kind)
	}
	if p.CheckOrder {
		if err := p.order.checkReplay(p, kind); err != nil {
			return false, err
		}
	}
	if p.Graphs[kind] == 0 {
		return false, nil
	}
	if err := l.graphs.Launch(p.Graphs[kind], stream); err != nil {
		return false, fmt.Errorf("graphed callable %d (%q): replaying its %s graph: %w", p.CallableIndex, p.Label, kind, err)
	}
	return true, nil
}

// Order orders stream for pass id's graph of kind as its replay would be
// ordered (Graphs.Order), without launching: what the caller enqueues on
// stream before the replay then runs after the previous replay of the
// graphs sharing its capture stream. A pass that cannot replay kind, or has
// no graph for it (eager), orders nothing: the replay reports why.
func (l *Ledger) Order(id int64, kind GraphKind, stream int64) (bool, error) {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return false, err
	}
	defer p.mu.Unlock()
	if p.Lifecycle != Ready || !p.Has[kind] || p.Graphs[kind] == 0 {
		return false, nil
	}
	if err := l.graphs.Order(p.Graphs[kind], stream); err != nil {
		return false, fmt.Errorf("graphed callable %d (%q): ordering the replay of its %s graph: %w", p.CallableIndex, p.Label, kind, err)
	}
	return true, nil
}

// State returns pass id's lifecycle.
func (l *Ledger) State(id int64) (Lifecycle, error) {
	p, err := l.lock(id)
	if err != nil {
		return 0, err
	}
	defer p.mu.Unlock()
	return p.Lifecycle, nil
}

// Graph returns the handle pass id holds for kind: 0 when the kind is absent,
// eager, or the pass was reset (its graphs no longer exist).
func (l *Ledger) Graph(id int64, kind GraphKind) (int64, error) {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return 0, err
	}
	defer p.mu.Unlock()
	return p.Graphs[kind], nil
}

// Snapshot returns a copy of pass id's record.
func (l *Ledger) Snapshot(id int64) (Pass, error) {
	p, err := l.lock(id)
	if err != nil {
		return Pass{}, err
	}
	defer p.mu.Unlock()
	return p.Pass, nil
}

// ResetPass destroys every graph pass id owns, moves it to Reset and returns
// how many pool references the caller must now release (then zeroes them, so
// a second call returns 0 and nil). It works from Building too, for a capture
// that failed half way (a capture still open is aborted first). If a graph
// fails to be destroyed the others are still destroyed, the pass is still
// reset and its pool references still returned, alongside the first error
// (also kept as the record's ResetErr): a graph is never destroyed twice.
func (l *Ledger) ResetPass(id int64) (int, error) {
	p, err := l.lock(id)
	if err != nil {
		return 0, err
	}
	defer p.mu.Unlock()
	return l.reset(p)
}

// reset does ResetPass's work on a locked record.
func (l *Ledger) reset(p *record) (int, error) {
	var first error
	if p.open.active {
		// A capture the caller never ended (it failed on the Python side
		// before it could abort): end it so the stream is usable again.
		first = l.abortOpen(p)
	}
	var destroyed []int64
	for k := GraphKind(0); k < NumKinds; k++ {
		g := p.Graphs[k]
		p.Graphs[k] = 0
		if g == 0 {
			continue
		}
		destroyed = append(destroyed, g)
		if err := l.graphs.Destroy(g); err != nil && first == nil {
			first = fmt.Errorf("graphed callable %d (%q): destroying its %s graph: %w", p.CallableIndex, p.Label, k, err)
		}
	}
	if len(destroyed) > 0 {
		l.mu.Lock()
		for _, g := range destroyed {
			delete(l.owner, g)
		}
		l.mu.Unlock()
	}
	p.Lifecycle = Reset
	if p.CheckOrder {
		p.order.forget(p.ID) // a reset pass needs nothing any more
	}
	refs := p.PoolRefs
	p.PoolRefs = 0
	if refs > 0 {
		l.mu.Lock()
		if l.poolRefs[p.Pool] -= refs; l.poolRefs[p.Pool] <= 0 {
			delete(l.poolRefs, p.Pool)
		}
		l.mu.Unlock()
	}
	if first != nil {
		p.ResetErr = first.Error()
	}
	return refs, first
}

// DropPass resets pass id if needed and forgets it (Python finalizers). It
// returns the pool references the reset handed back, which the caller must
// release. An unknown id is not an error: finalizers may run after an
// explicit drop.
func (l *Ledger) DropPass(id int64) (int, error) {
	l.mu.Lock()
	p := l.passes[id]
	delete(l.passes, id)
	l.mu.Unlock()
	if p == nil {
		return 0, nil
	}
	// A replay that found the record before it left the map may still hold
	// it; taking its lock waits for that replay, and later ones see Reset.
	p.mu.Lock()
	defer p.mu.Unlock()
	if po := p.order; po != nil {
		l.mu.Lock()
		if po.refs--; po.refs <= 0 && l.pools[po.key] == po {
			delete(l.pools, po.key) // no record left in the pool: forget its order
		}
		l.mu.Unlock()
	}
	return l.reset(p)
}

// PoolRefs returns how many references the live records hold on pool (by
// key): what the caller's allocator must still be holding for them.
func (l *Ledger) PoolRefs(pool string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.poolRefs[pool]
}

// ResetError returns why pass id's last reset failed to destroy a graph, or
// "" when it did not fail (or the pass was never reset).
func (l *Ledger) ResetError(id int64) (string, error) {
	p, err := l.lock(id)
	if err != nil {
		return "", err
	}
	defer p.mu.Unlock()
	return p.ResetErr, nil
}

// LivePasses returns how many records exist (not dropped).
func (l *Ledger) LivePasses() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.passes)
}

// Owner returns the id of the pass that owns graph, or 0 when none does.
func (l *Ledger) Owner(graph int64) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.owner[graph]
}
