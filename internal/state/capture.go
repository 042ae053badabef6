package state

// The capture transaction: how a graph comes to belong to a pass.
//
// One capture of one kind of a pass is two calls on the success path:
//
//	BeginCapture(pass, kind, pool, stream, mode)  pool reference counted, stream capture begun
//	EndCapture(pass, kind, stream) -> seq          graph ended, instantiated, attached, ordered
//
// and AbortCapture instead of EndCapture when the captured work failed. The
// ledger decides and the caller executes: Python routes torch's allocations
// to the pool and runs the body between the two calls; everything that can
// leak (a pool reference, a stream left capturing, a graph nobody owns) is
// settled here, in one place:
//
//   - BeginCapture changes nothing when it fails: the pool reference is
//     counted on the pass and its pool only once the stream capture began;
//   - after a successful BeginCapture the reference belongs to the pass,
//     whatever happens next, and is handed back by ResetPass;
//   - EndCapture either attaches the graph and records its sequence number
//     in the pool, or destroys whatever the driver produced;
//   - a capture that is never ended is aborted by ResetPass.
//
// Stream 0 captures nothing (the eager engine): the kind is attached with
// graph handle 0 and its capture order is recorded all the same, so the
// lifecycle and the replay-order guard behave alike on both engines.

import "fmt"

// openCapture is the capture underway on a record, between BeginCapture and
// EndCapture or AbortCapture.
type openCapture struct {
	active bool
	kind   GraphKind
	stream int64
}

// BeginCapture opens the capture of pass id's kind in pool (a key that is
// equal for all captures sharing a memory pool) on stream in mode (the
// driver's capture mode; ignored for stream 0). The pass must be Building,
// have no graph of that kind yet and no capture open, and keep all its
// graphs in one pool. On success one pool reference is counted on the pass
// and the pool; on failure nothing changed.
func (l *Ledger) BeginCapture(id int64, kind GraphKind, pool string, stream int64, mode int) error {
	if err := checkKind(kind); err != nil {
		return err
	}
	if pool == "" {
		return fmt.Errorf("begin capture: empty pool key")
	}
	p, err := l.lock(id)
	if err != nil {
		return err
	}
	defer p.mu.Unlock()
	if err := p.canBegin(kind, pool); err != nil {
		return err
	}
	if stream != 0 {
		if err := l.graphs.BeginCapture(stream, mode); err != nil {
			return fmt.Errorf("graphed callable %d (%q): beginning its %s capture: %w", p.CallableIndex, p.Label, kind, err)
		}
	}
	l.joinPool(p, pool)
	p.PoolRefs++
	p.open = openCapture{active: true, kind: kind, stream: stream}
	return nil
}

// canBegin checks that a locked record may begin capturing kind in pool.
func (p *record) canBegin(kind GraphKind, pool string) error {
	switch {
	case p.Lifecycle == Reset:
		return p.errReset()
	case p.Lifecycle != Building:
		return fmt.Errorf("graphed callable %d (%q) is sealed; cannot capture a %s graph", p.CallableIndex, p.Label, kind)
	case p.open.active:
		return fmt.Errorf("graphed callable %d (%q): its %s capture is still open; end or abort it before capturing its %s", p.CallableIndex, p.Label, p.open.kind, kind)
	case p.Has[kind]:
		return fmt.Errorf("graphed callable %d (%q) already has a %s graph", p.CallableIndex, p.Label, kind)
	case p.Pool != "" && p.Pool != pool:
		return fmt.Errorf("graphed callable %d (%q): its %s capture is in pool %q but its earlier captures are in pool %q; a pass's graphs share one pool", p.CallableIndex, p.Label, kind, pool, p.Pool)
	}
	return nil
}

// joinPool counts one reference of the locked record p on pool, associating
// p with the pool's capture order on its first capture.
func (l *Ledger) joinPool(p *record, pool string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.poolRefs[pool]++
	if p.order != nil {
		return
	}
	po := l.pools[pool]
	if po == nil {
		po = &poolOrder{key: pool, next: 1}
		l.pools[pool] = po
	}
	po.refs++
	p.order, p.Pool = po, pool
}

// EndCapture ends pass id's open capture of kind on stream: the driver ends
// and instantiates the graph (stream 0: nothing to launch, handle 0), the
// pass takes ownership of it and the capture's sequence number in the pool is
// recorded and returned (from 1; the replay-order guard orders replays by
// it). On failure the driver's result is destroyed, nothing is attached and
// the capture is closed; the pool reference stays with the pass.
func (l *Ledger) EndCapture(id int64, kind GraphKind, stream int64) (int, error) {
	p, err := l.lockOpen(id, kind, stream)
	if err != nil {
		return 0, err
	}
	defer p.mu.Unlock()
	p.open = openCapture{}
	var graph int64
	if stream != 0 {
		graph, err = l.graphs.EndCapture(stream)
		if err != nil {
			return 0, fmt.Errorf("graphed callable %d (%q): ending its %s capture: %w", p.CallableIndex, p.Label, kind, err)
		}
	}
	if graph != 0 {
		l.mu.Lock()
		l.owner[graph] = id
		l.mu.Unlock()
	}
	p.Graphs[kind], p.Has[kind] = graph, true
	return p.recordSeq(kind), nil
}

// AbortCapture closes pass id's open capture of kind after the captured work
// failed: the stream's capture is ended and whatever it produced destroyed.
// The pool reference stays with the pass. Aborting when no capture of that
// kind is open is not an error (a cleanup path may run twice).
func (l *Ledger) AbortCapture(id int64, kind GraphKind, stream int64) error {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return err
	}
	defer p.mu.Unlock()
	if !p.open.active || p.open.kind != kind || p.open.stream != stream {
		return nil
	}
	return l.abortOpen(p)
}

// abortOpen aborts the locked record's open capture.
func (l *Ledger) abortOpen(p *record) error {
	c := p.open
	p.open = openCapture{}
	if c.stream == 0 {
		return nil
	}
	if err := l.graphs.AbortCapture(c.stream); err != nil {
		return fmt.Errorf("graphed callable %d (%q): aborting its %s capture: %w", p.CallableIndex, p.Label, c.kind, err)
	}
	return nil
}

// lockOpen returns pass id locked when its open capture is kind on stream.
func (l *Ledger) lockOpen(id int64, kind GraphKind, stream int64) (*record, error) {
	p, err := l.lockKind(id, kind)
	if err != nil {
		return nil, err
	}
	if !p.open.active || p.open.kind != kind || p.open.stream != stream {
		defer p.mu.Unlock()
		return nil, fmt.Errorf("graphed callable %d (%q) has no %s capture open on stream %d; call begin_pass_capture first", p.CallableIndex, p.Label, kind, stream)
	}
	return p, nil
}
