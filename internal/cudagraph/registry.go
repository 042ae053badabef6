package cudagraph

import (
	"fmt"
	"sync"
)

// Registry is the capture engine over one Driver: it tracks the streams
// capturing through it and owns every instantiated graph, handing out int64
// handles (from 1, never reused, so a stale handle can never name a newer
// graph). Its methods implement the capture section of docs/CORE_API.md and
// are named after the exported operation they serve; every error they return
// starts with that operation's Python name (e.g. "end_capture: ...").
//
// A Registry is safe for concurrent use. Driver calls are made on the calling
// goroutine and, except where a handle's lifetime demands it, outside the
// registry's locks, so a slow instantiate on one thread never stalls replays
// on another.
type Registry struct {
	drv Driver

	capMu     sync.Mutex
	capturing map[uintptr]captureState // streams whose capture goes through us

	// graphMu guards graphs and next. Launch, Upload and NodeCount hold the
	// read lock across their driver call and Destroy takes the write lock to
	// unregister, so a graph is never freed while another thread is using it.
	graphMu sync.RWMutex
	graphs  map[int64]graphPair
	next    int64

	orderMu sync.Mutex
	orders  map[uintptr]*replayOrder // capture stream -> the order of its graphs' launches
}

// replayOrder orders the launches of the graphs captured on one stream. They
// share that stream's cuBLAS workspace: torch keys it by (handle, stream) and
// every captured GEMM node holds its raw address (pytorch#193402). Two of them
// running at once on two streams -- two threads, each training its own model
// on its own stream -- race on it and compute wrong results (measured on the
// H200: 1 to 4 of 7 runs of tests/hardening/test_hardening_threads.py's
// two-thread test). So a launch on another stream than the previous launch's
// first waits for that stream: one event record and one wait at each switch;
// launches that stay on one stream, the usual case, pay one comparison.
type replayOrder struct {
	capture uintptr // the capture stream (its context owns event)

	mu    sync.Mutex // held from the check to the launch: the check, wait and launch are one step
	last  uintptr    // the stream of the latest launch (valid once ran is set)
	ran   bool       // some graph of this order was launched
	event RawEvent   // recorded on last at a switch (0 until the first switch)
}

// captureState is where a stream's capture through the registry stands. The
// transitional states keep a second thread from beginning or ending the same
// stream while the first one is inside the driver.
type captureState int

const (
	stateBeginning captureState = iota + 1 // BeginCapture is in the driver
	stateCapturing                         // begun, not yet ended
	stateEnding                            // EndCapture or AbortCapture is in the driver
)

// graphPair is one registered graph: the executable that is launched and the
// graph it was instantiated from (kept for NodeCount, freed with it).
type graphPair struct {
	graph RawGraph
	exec  RawExec
	order *replayOrder // shared by every graph captured on the same stream
}

// NewRegistry returns an empty registry over drv. A panic in a drv call is
// recovered and handled as that call's error (see PanicError).
func NewRegistry(drv Driver) *Registry {
	return &Registry{
		drv:       recovering(drv),
		capturing: make(map[uintptr]captureState),
		graphs:    make(map[int64]graphPair),
		next:      1,
		orders:    make(map[uintptr]*replayOrder),
	}
}

// Driver returns the driver the registry calls, for the device and version
// queries that need no bookkeeping.
func (r *Registry) Driver() Driver { return r.drv }

// streamHandle converts a stream as Python passes it (a CUstream value in an
// int64) to the driver's integer form. Through uint64 so that the bits are
// kept whatever the sign (gopy already refuses Python ints beyond int64).
func streamHandle(stream int64) uintptr { return uintptr(uint64(stream)) }

func opError(op string, err error) error { return fmt.Errorf("%s: %w", op, err) }

// BeginCapture starts capturing stream in mode. It refuses the legacy
// default stream, unknown modes and a stream already capturing through the
// registry, before the driver is asked.
func (r *Registry) BeginCapture(stream int64, mode int) error {
	const op = "begin_capture"
	if stream == 0 {
		// Capturing the legacy stream is illegal and would also be confused
		// with "no stream" everywhere else; say what to do instead.
		return fmt.Errorf("%s: refusing to capture the legacy default stream (0): capture on a side stream such as torch.cuda.Stream()", op)
	}
	m := Mode(mode)
	if !m.Valid() {
		return fmt.Errorf("%s: unknown capture mode %d (want 0 global, 1 thread_local or 2 relaxed)", op, mode)
	}
	s := streamHandle(stream)

	r.capMu.Lock()
	if st, busy := r.capturing[s]; busy {
		r.capMu.Unlock()
		return fmt.Errorf("%s: stream %d is already capturing through gograph (%s); end_capture or abort_capture it first", op, stream, st.describe())
	}
	r.capturing[s] = stateBeginning
	r.capMu.Unlock()

	err := r.drv.BeginCapture(s, m)

	r.capMu.Lock()
	if err != nil {
		delete(r.capturing, s)
	} else {
		r.capturing[s] = stateCapturing
	}
	r.capMu.Unlock()
	if err != nil {
		return opError(op, err)
	}
	return nil
}

func (st captureState) describe() string {
	switch st {
	case stateBeginning:
		return "a begin_capture is in progress"
	case stateEnding:
		return "an end_capture or abort_capture is in progress"
	}
	return "capture active"
}

// claimEnd moves a capturing stream to stateEnding. It fails when the stream
// is not capturing through the registry or another thread is mid-call on it.
func (r *Registry) claimEnd(op string, s uintptr, stream int64) error {
	r.capMu.Lock()
	defer r.capMu.Unlock()
	switch st, ok := r.capturing[s]; {
	case !ok:
		return fmt.Errorf("%s: stream %d is not capturing through gograph; call begin_capture first", op, stream)
	case st != stateCapturing:
		return fmt.Errorf("%s: stream %d: %s on another thread", op, stream, st.describe())
	}
	r.capturing[s] = stateEnding
	return nil
}

// settle records the outcome of a driver call that may or may not have ended
// capture on s. When the call failed the stream may still be capturing (e.g.
// ended from the wrong thread in thread_local mode); the driver is asked, and
// a stream that is still capturing and was ours (keep) stays ours to end or
// abort later. Otherwise the stream is forgotten.
func (r *Registry) settle(s uintptr, callErr error, keep bool) {
	still := false
	if callErr != nil && keep {
		if st, err := r.drv.IsCapturing(s); err == nil && st != StatusNone {
			still = true
		}
	}
	r.capMu.Lock()
	if still {
		r.capturing[s] = stateCapturing
	} else {
		delete(r.capturing, s)
	}
	r.capMu.Unlock()
}

// joinErrs combines the error that matters with a later one (typically a
// cleanup failure) into one line, as Python shows only the message.
func joinErrs(err, later error) error {
	switch {
	case later == nil:
		return err
	case err == nil:
		return later
	}
	return fmt.Errorf("%w; then %w", err, later)
}

// destroyRaw frees a graph that was never registered, keeping err as the
// error that matters and adding a cleanup failure to it.
func (r *Registry) destroyRaw(g RawGraph, err error) error {
	if g == 0 {
		return err
	}
	return joinErrs(err, r.drv.DestroyGraph(g))
}

// EndCapture ends capture on stream, instantiates the graph and registers
// it, returning its handle. On any failure nothing stays registered and the
// raw graph, if the driver produced one, is destroyed.
func (r *Registry) EndCapture(stream int64) (int64, error) {
	const op = "end_capture"
	s := streamHandle(stream)
	if err := r.claimEnd(op, s, stream); err != nil {
		return 0, err
	}
	g, err := r.drv.EndCapture(s)
	r.settle(s, err, true)
	if err != nil {
		return 0, opError(op, r.destroyRaw(g, err))
	}
	if g == 0 {
		// Not something a driver does, but a zero graph cannot be
		// instantiated and must not get a handle.
		return 0, fmt.Errorf("%s: stream %d: the driver returned no graph", op, stream)
	}
	e, err := r.drv.Instantiate(g)
	if err != nil {
		return 0, opError(op, r.destroyRaw(g, err))
	}

	order := r.orderOf(s)
	r.graphMu.Lock()
	id := r.next
	r.next++
	r.graphs[id] = graphPair{graph: g, exec: e, order: order}
	r.graphMu.Unlock()
	return id, nil
}

// AbortCapture is the cleanup path for a capture that went wrong: if stream
// is capturing (active or invalidated), it ends the capture and destroys
// whatever graph came out. It is not an error when nothing was capturing. It
// acts on the stream's driver state, so it also clears a stream whose capture
// was begun through the registry but is no longer known to the driver.
func (r *Registry) AbortCapture(stream int64) error {
	const op = "abort_capture"
	if stream == 0 {
		return nil // the legacy stream is never captured through us
	}
	s := streamHandle(stream)

	r.capMu.Lock()
	prev, ours := r.capturing[s]
	if ours && prev != stateCapturing {
		r.capMu.Unlock()
		return fmt.Errorf("%s: stream %d: %s on another thread", op, stream, prev.describe())
	}
	// Claim the stream even when it is not ours, so no begin_capture
	// through us races with the abort.
	r.capturing[s] = stateEnding
	r.capMu.Unlock()

	restore := func() {
		r.capMu.Lock()
		if ours {
			r.capturing[s] = prev
		} else {
			delete(r.capturing, s)
		}
		r.capMu.Unlock()
	}

	st, err := r.drv.IsCapturing(s)
	if err != nil {
		restore()
		return opError(op, err)
	}
	if st == StatusNone {
		r.capMu.Lock()
		delete(r.capturing, s)
		r.capMu.Unlock()
		return nil
	}
	g, err := r.drv.EndCapture(s)
	r.settle(s, err, ours)
	// An invalidated capture makes EndCapture fail by design; that failure is
	// the expected outcome of an abort, not an error to report.
	if err != nil && ErrorCode(err) == CodeStreamCaptureInvalidated {
		err = nil
	}
	if g != 0 {
		err = joinErrs(err, r.drv.DestroyGraph(g))
	}
	if err != nil {
		return opError(op, err)
	}
	return nil
}

// CaptureStatus reports the driver's capture status of stream.
func (r *Registry) CaptureStatus(stream int64) (int, error) {
	st, err := r.drv.IsCapturing(streamHandle(stream))
	if err != nil {
		return 0, opError("capture_status", err)
	}
	return int(st), nil
}

// ExchangeCaptureMode sets the calling thread's capture mode and returns the
// previous one.
func (r *Registry) ExchangeCaptureMode(mode int) (int, error) {
	const op = "exchange_capture_mode"
	m := Mode(mode)
	if !m.Valid() {
		return 0, fmt.Errorf("%s: unknown capture mode %d (want 0 global, 1 thread_local or 2 relaxed)", op, mode)
	}
	prev, err := r.drv.ExchangeMode(m)
	if err != nil {
		return 0, opError(op, err)
	}
	return int(prev), nil
}

// withGraph runs fn on a registered graph while holding the read lock, so
// Destroy waits until fn is done with it.
func (r *Registry) withGraph(op string, graph int64, fn func(graphPair) error) error {
	r.graphMu.RLock()
	defer r.graphMu.RUnlock()
	p, ok := r.graphs[graph]
	if !ok {
		return unknownGraph(op, graph)
	}
	if err := fn(p); err != nil {
		return opError(op, err)
	}
	return nil
}

func unknownGraph(op string, graph int64) error {
	return fmt.Errorf("%s: unknown graph handle %d (never created or already destroyed)", op, graph)
}

// orderOf returns the launch order of the graphs captured on stream s.
// Orders are never dropped: there is one per capture stream, and torch's
// streams live as long as the process.
func (r *Registry) orderOf(s uintptr) *replayOrder {
	r.orderMu.Lock()
	defer r.orderMu.Unlock()
	o := r.orders[s]
	if o == nil {
		o = &replayOrder{capture: s}
		r.orders[s] = o
	}
	return o
}

// Launch enqueues a replay of graph on stream, after the previous launch of
// any graph captured on the same stream (see replayOrder). A failure to
// order it launches nothing: racing on the workspace would be silently wrong.
func (r *Registry) Launch(graph, stream int64) error {
	return r.ordered("launch_graph", graph, stream, func(p graphPair, o *replayOrder, s uintptr) error {
		if err := r.drv.Launch(p.exec, s); err != nil {
			return err
		}
		o.last, o.ran = s, true
		return nil
	})
}

// Order orders stream as Launch would, without launching: stream waits for
// the previous launch of any graph captured on graph's capture stream when
// that ran on another stream, and then counts as the latest stream. What the
// caller enqueues on stream next (an RNG companion's seed and offset writes,
// which the previous replay's kernels may still be reading, then the graph's
// launch) runs after that replay. A failure leaves the order as it was.
func (r *Registry) Order(graph, stream int64) error {
	return r.ordered("order_replay", graph, stream, func(_ graphPair, o *replayOrder, s uintptr) error {
		if o.ran {
			o.last = s // s now waits for everything o.last had: later switches wait for s
		}
		return nil
	})
}

// ordered runs then under graph's order lock, once stream waits for the
// order's previous stream (then is not run when that wait fails).
func (r *Registry) ordered(op string, graph, stream int64, then func(graphPair, *replayOrder, uintptr) error) error {
	return r.withGraph(op, graph, func(p graphPair) error {
		o, s := p.order, streamHandle(stream)
		o.mu.Lock()
		defer o.mu.Unlock()
		if err := r.orderOn(o, s); err != nil {
			return err
		}
		return then(p, o, s)
	})
}

// orderOn makes s wait for o.last when the previous launch ran there. o.mu
// is held.
func (r *Registry) orderOn(o *replayOrder, s uintptr) error {
	if !o.ran || o.last == s {
		return nil
	}
	if err := r.waitForLast(o, s); err != nil {
		return fmt.Errorf("ordering the replay on stream %d after the previous replay on stream %d "+
			"(graphs captured on one stream share its cuBLAS workspace and torch's RNG offsets): %w",
			int64(s), int64(o.last), err)
	}
	return nil
}

// waitForLast makes stream s wait for the work enqueued so far on o.last.
// o.mu is held.
func (r *Registry) waitForLast(o *replayOrder, s uintptr) error {
	if o.event == 0 {
		ev, err := r.drv.EventCreate(o.capture)
		if err != nil {
			return err
		}
		o.event = ev
	}
	if err := r.drv.EventRecord(o.event, o.last); err != nil {
		return err
	}
	return r.drv.StreamWaitEvent(s, o.event)
}

// Upload uploads graph to the device on stream ahead of its first launch.
func (r *Registry) Upload(graph, stream int64) error {
	return r.withGraph("upload_graph", graph, func(p graphPair) error {
		return r.drv.Upload(p.exec, streamHandle(stream))
	})
}

// NodeCount returns how many nodes graph has.
func (r *Registry) NodeCount(graph int64) (int, error) {
	var n int
	err := r.withGraph("graph_node_count", graph, func(p graphPair) error {
		var err error
		n, err = r.drv.NodeCount(p.graph)
		return err
	})
	return n, err
}

// Destroy frees graph and unregisters its handle. The handle is gone even if
// the driver fails to free it: a half-destroyed graph must never be launched,
// and trying again could free it twice. Destroying an unknown handle is an
// error.
func (r *Registry) Destroy(graph int64) error {
	const op = "destroy_graph"
	r.graphMu.Lock()
	p, ok := r.graphs[graph]
	delete(r.graphs, graph)
	r.graphMu.Unlock()
	if !ok {
		return unknownGraph(op, graph)
	}
	// The executable is freed first: it was made from the graph.
	err := joinErrs(r.drv.DestroyExec(p.exec), r.drv.DestroyGraph(p.graph))
	if err != nil {
		return opError(op, err)
	}
	return nil
}

// Has reports whether graph is a registered handle now.
func (r *Registry) Has(graph int64) bool {
	r.graphMu.RLock()
	defer r.graphMu.RUnlock()
	_, ok := r.graphs[graph]
	return ok
}

// LiveGraphs returns how many graphs are registered now.
func (r *Registry) LiveGraphs() int {
	r.graphMu.RLock()
	defer r.graphMu.RUnlock()
	return len(r.graphs)
}

// Capturing returns how many streams are capturing through the registry now
// (including ones mid-begin or mid-end), for leak checks.
func (r *Registry) Capturing() int {
	r.capMu.Lock()
	defer r.capMu.Unlock()
	return len(r.capturing)
}
