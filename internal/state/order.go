package state

// Capture order and the replay-order guard.
//
// Graphs that share a memory pool were captured one after another, and each
// capture could only use pool memory that was free at the time. The caching
// allocator hands memory freed by an earlier capture to a later one, so a
// graph may write, as scratch or as its own outputs, memory that some other
// graph of the pool still held at a different point of the capture sequence.
// That is safe exactly when the graphs replay in the order they were captured.
//
// # The rule
//
// Every capture records a sequence number in its pool (1, 2, ... per pool
// key). A pass's kinds form a chain in capture order, normally
// forward < backward [< wgrad]. Replaying the first kind of a chain opens the
// pass ("in flight"): memory allocated by its captures is now needed by the
// kinds still to come. The pass closes when its last kind replays (or it is
// discarded or reset). While pass Q is open, its data sits in memory that was
// allocated, at capture time, from Q's opening capture (sequence lo) until
// Q's last capture (sequence hi), and was free before lo and after hi. A graph
// of the same pool captured at sequence s therefore cannot touch that data iff
//
//	lo < s < hi
//
// and may overwrite it otherwise. With the guard on, a replay of graph s in a
// pool where some other open pass Q has s < lo or s > hi is refused, naming
// both passes, before anything is launched.
//
// Replaying in capture order always satisfies the rule: a pass is open only
// between the replays of its first and last captures, and everything replayed
// in between was captured in between. So do fwd 1..n, bwd n..1 repeated (each
// iteration closes every pass), pipeline schedules captured in their own order
// (TransformerEngine's _order), and chains of forward-only passes (a pass
// without a later kind never opens). A pass's own first kind replayed again
// re-opens it (its previous forward is abandoned; that is not a hazard for
// other passes), and Python discards the opening of a forward whose backward
// can never run (run under no_grad), so evaluation loops over graphs captured
// for training do not keep passes open.
//
// The check costs nothing for passes without the guard beyond one bool test
// in Replay; with it, one pool lock and a scan of the open passes. Sequence
// numbers are given by EndCapture (capture.go).

import (
	"fmt"
	"strings"
	"sync"

	"github.com/gograph/gograph/internal/recarve"
)

// poolOrder is the capture sequence and the replay-order state of one memory
// pool (by the key Python gave when recording captures). Its lock is taken
// after a record's lock and after the ledger's, never before.
type poolOrder struct {
	key string

	// refs counts the records that recorded a capture in this pool and were
	// not dropped; guarded by the Ledger's lock.
	refs int

	mu   sync.Mutex
	next int      // next capture sequence number
	open []flight // open passes, in the order they opened

	// carve is the precise checker (internal/recarve) for the graphs whose
	// writes and reads the executor gave (SetRecarveSpec); nil until then.
	// A guarded graph it knows is checked by it instead of the capture-order
	// rule: any order passes unless memory another graph still needs would
	// be overwritten or read after being overwritten.
	carve *recarve.Pool
}

// knows reports whether the precise checker has graph kind of pass id.
func (po *poolOrder) knows(id int64, kind GraphKind) bool {
	return po.carve != nil && po.carve.Knows(recarve.Graph{Pass: id, Kind: int(kind)})
}

// SetRecarveSpec gives the precise checker what pass id's kind graph writes
// and reads in its pool at every replay (recarve.ParseSpec's text).
func (l *Ledger) SetRecarveSpec(id int64, kind GraphKind, spec string) error {
	if err := checkKind(kind); err != nil {
		return err
	}
	s, err := recarve.ParseSpec(spec)
	if err != nil {
		return err
	}
	p, err := l.lock(id)
	if err != nil {
		return err
	}
	defer p.mu.Unlock()
	if p.Lifecycle == Reset {
		return p.errReset()
	}
	if p.order == nil || p.Seq[kind] == 0 {
		return fmt.Errorf("gograph: graphed callable %d (%q): no %s capture recorded to check", p.CallableIndex, p.Label, kind)
	}
	p.order.mu.Lock()
	defer p.order.mu.Unlock()
	if p.order.carve == nil {
		p.order.carve = recarve.NewPool()
	}
	return p.order.carve.Add(recarve.Graph{Pass: id, Kind: int(kind)}, s)
}

// RecarveClobbers lists the hand-outs of other graphs (pool-planned
// buffers returned to the caller) that replaying pass id's kind graph
// overwrites, as the precise checker knows them; none when it does not
// know the graph.
func (l *Ledger) RecarveClobbers(id int64, kind GraphKind) ([]recarve.Clobber, error) {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return nil, err
	}
	defer p.mu.Unlock()
	if p.order == nil {
		return nil, nil
	}
	p.order.mu.Lock()
	defer p.order.mu.Unlock()
	if p.order.carve == nil {
		return nil, nil
	}
	return p.order.carve.Clobbers(recarve.Graph{Pass: id, Kind: int(kind)}), nil
}

// flight is an open pass: its replay chain started and has kinds to come.
type flight struct {
	id       int64
	who      *record   // for its name only: ID, CallableIndex and Label never change
	lo, hi   int       // capture sequence of the opening kind and of the last kind
	loKind   GraphKind // the kind whose replay opened it
	lastRun  GraphKind // the latest kind replayed
	pending  GraphKind // the next kind in its chain
	lastKind GraphKind // the last kind of its chain
}

// addToChain inserts kind, just recorded, into p's chain of kinds in capture
// order (kept on the record so that the replay check allocates nothing).
func (p *record) addToChain(kind GraphKind) {
	i := p.nchain
	for i > 0 && p.Seq[p.chain[i-1]] > p.Seq[kind] {
		p.chain[i] = p.chain[i-1]
		i--
	}
	p.chain[i] = kind
	p.nchain++
}

// name is how errors name a pass. It reads only fields that never change
// after NewPass, so it needs no lock.
func (p *Pass) name() string {
	return fmt.Sprintf("graphed callable %d (%q, pass %d)", p.CallableIndex, p.Label, p.ID)
}

// recordSeq gives the locked record's kind, just captured, the next capture
// sequence number of its pool (joined when its capture began) and returns it.
func (p *record) recordSeq(kind GraphKind) int {
	po := p.order
	po.mu.Lock()
	seq := po.next
	po.next++
	po.mu.Unlock()
	p.Seq[kind] = seq
	p.addToChain(kind)
	return seq
}

// CaptureSeq returns the capture sequence number of pass id's kind in its
// pool (0 when not recorded) and the pool key ("" when none).
func (l *Ledger) CaptureSeq(id int64, kind GraphKind) (int, string, error) {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return 0, "", err
	}
	defer p.mu.Unlock()
	return p.Seq[kind], p.Pool, nil
}

// SetOrderCheck turns the replay-order guard on or off for pass id. Turning
// it on needs at least one recorded capture; turning it off closes the pass
// if it was open. Not for a reset pass (turning it off is harmless there).
func (l *Ledger) SetOrderCheck(id int64, on bool) error {
	p, err := l.lock(id)
	if err != nil {
		return err
	}
	defer p.mu.Unlock()
	if !on {
		if p.CheckOrder {
			p.CheckOrder = false
			p.order.forget(id)
		}
		return nil
	}
	switch {
	case p.Lifecycle == Reset:
		return p.errReset()
	case p.order == nil:
		return fmt.Errorf("gograph: graphed callable %d (%q) has no recorded capture; the replay-order guard needs the capture order", p.CallableIndex, p.Label)
	}
	p.CheckOrder = true
	return nil
}

// DiscardOpen closes pass id if it is open (its pending kinds will not run,
// e.g. a forward replayed under no_grad) and reports whether it was open.
func (l *Ledger) DiscardOpen(id int64) (bool, error) {
	p, err := l.lock(id)
	if err != nil {
		return false, err
	}
	defer p.mu.Unlock()
	if !p.CheckOrder {
		return false, nil
	}
	if p.order.carve != nil {
		p.order.mu.Lock()
		p.order.carve.Discard(id)
		p.order.mu.Unlock()
	}
	return p.order.close(id), nil
}

// OrderState describes the open passes of pool, one per line in the order
// they opened, e.g. `graphed callable 0 ("A", pass 6): opened by its forward
// (capture #1), last ran its forward, backward pending (its last capture is #4)`.
// Empty when none is open or the pool is unknown.
func (l *Ledger) OrderState(pool string) string {
	l.mu.Lock()
	po := l.pools[pool]
	l.mu.Unlock()
	if po == nil {
		return ""
	}
	po.mu.Lock()
	defer po.mu.Unlock()
	lines := make([]string, 0, len(po.open))
	for _, f := range po.open {
		lines = append(lines, fmt.Sprintf("%s: opened by its %s (capture #%d), last ran its %s, %s pending (its last capture is #%d)",
			f.who.name(), f.loKind, f.lo, f.lastRun, f.pending, f.hi))
	}
	return strings.Join(lines, "\n")
}

// checkReplay is Replay's guard for a record with CheckOrder set (p locked):
// it refuses a replay that could overwrite memory an open pass of the pool
// still needs, and otherwise moves p's own chain along.
func (po *poolOrder) checkReplay(p *record, kind GraphKind) error {
	s := p.Seq[kind]
	if s == 0 {
		return nil // a kind attached without a recorded capture: nothing known
	}
	po.mu.Lock()
	defer po.mu.Unlock()
	if po.knows(p.ID, kind) {
		return po.carve.Replay(recarve.Graph{Pass: p.ID, Kind: int(kind)})
	}
	if err := po.check(p, kind, s); err != nil {
		return err
	}
	chain := p.chain[:p.nchain]
	first, last := chain[0], chain[len(chain)-1]
	at := po.find(p.ID)
	switch {
	case kind == first:
		if at >= 0 {
			po.remove(at)
		}
		if first != last {
			po.open = append(po.open, po.newFlight(p, chain, kind))
		}
	case at >= 0:
		if kind == last {
			po.remove(at)
		} else {
			f := &po.open[at]
			f.lastRun, f.pending = kind, next(chain, kind)
		}
	case kind != last:
		// A later kind without an open chain (e.g. a backward replayed again
		// with retain_graph): what it leaves for the kinds after it is needed.
		po.open = append(po.open, po.newFlight(p, chain, kind))
	}
	return nil
}

// check returns the violation replaying p's kind (capture s) would be, if any
// (po locked).
func (po *poolOrder) check(p *record, kind GraphKind, s int) error {
	for i := range po.open {
		f := &po.open[i]
		if f.id == p.ID || (f.lo < s && s < f.hi) {
			continue
		}
		return po.violation(&p.Pass, kind, s, f)
	}
	return nil
}

// CheckOrder returns the error Replay's guard would raise for pass id's kind
// now, without replaying or changing anything: callers that modify static
// buffers before a replay check first, so that a refused replay leaves them
// untouched. Nil when the guard is off for the pass, the pass is not ready
// (Replay reports that) or the kind's capture was not recorded.
func (l *Ledger) CheckOrder(id int64, kind GraphKind) error {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return err
	}
	defer p.mu.Unlock()
	s := p.Seq[kind]
	if !p.CheckOrder || p.Lifecycle != Ready || s == 0 {
		return nil
	}
	p.order.mu.Lock()
	defer p.order.mu.Unlock()
	if p.order.knows(id, kind) {
		return p.order.carve.Check(recarve.Graph{Pass: id, Kind: int(kind)})
	}
	return p.order.check(p, kind, s)
}

func (po *poolOrder) newFlight(p *record, chain []GraphKind, opened GraphKind) flight {
	last := chain[len(chain)-1]
	return flight{
		id: p.ID, who: p,
		lo: p.Seq[opened], hi: p.Seq[last],
		loKind: opened, lastRun: opened, pending: next(chain, opened), lastKind: last,
	}
}

// next returns the kind after k in chain (k itself when it is the last).
func next(chain []GraphKind, k GraphKind) GraphKind {
	for i, c := range chain {
		if c == k && i+1 < len(chain) {
			return chain[i+1]
		}
	}
	return k
}

func (po *poolOrder) find(id int64) int {
	for i := range po.open {
		if po.open[i].id == id {
			return i
		}
	}
	return -1
}

func (po *poolOrder) remove(i int) {
	po.open = append(po.open[:i], po.open[i+1:]...)
}

// close removes pass id from the open passes; it reports whether it was open.
// forget closes pass id and drops its graphs from the precise checker (its
// guard went off, or it was reset: it neither writes nor needs anything).
func (po *poolOrder) forget(id int64) {
	if po == nil {
		return
	}
	po.close(id)
	po.mu.Lock()
	defer po.mu.Unlock()
	if po.carve != nil {
		po.carve.ForgetPass(id)
	}
}

func (po *poolOrder) close(id int64) bool {
	if po == nil {
		return false
	}
	po.mu.Lock()
	defer po.mu.Unlock()
	if i := po.find(id); i >= 0 {
		po.remove(i)
		return true
	}
	return false
}

// violation builds the error for replaying p's kind (capture s) while f is open.
func (po *poolOrder) violation(p *Pass, kind GraphKind, s int, f *flight) error {
	other := f.who.name()
	var why string
	if s < f.lo {
		why = fmt.Sprintf("it was captured before that pass's %s (capture #%d < #%d in the pool), when that memory was still free",
			f.loKind, s, f.lo)
	} else {
		why = fmt.Sprintf("it was captured after that pass's %s (capture #%d > #%d in the pool), when that memory was free again",
			f.lastKind, s, f.hi)
	}
	return fmt.Errorf("gograph: replay order: refusing to replay the %s of %s: %s ran its %s and its %s has not run since, "+
		"and this %s may overwrite memory that %s still reads: %s. Graphs that share a memory pool must be "+
		"replayed in the order they were captured (pool %s); run the %s of %s first, or capture in the order you replay "+
		"(a forward whose backward will never run belongs under torch.no_grad())",
		kind, p.name(), other, f.loKind, f.pending,
		kind, other, why,
		po.key, f.pending, other)
}
