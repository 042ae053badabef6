package cudagraph

import (
	"fmt"
	"sync"
)

// fakeDriver is an in-memory CUDA driver for testing the registry without a
// GPU. It models stream capture status, graph and executable lifetimes and
// launches, lets tests inject failures, and counts misuse (any call on a
// freed or unknown handle) so tests can assert the registry never commits it.
type fakeDriver struct {
	mu      sync.Mutex
	streams map[uintptr]*fakeStream
	graphs  map[RawGraph]int     // live graphs -> node count
	execs   map[RawExec]RawGraph // live executables -> source graph
	next    uintptr
	mode    Mode

	launches int
	uploads  int
	misuse   []string
	events   map[RawEvent]uintptr // live events -> the stream whose context created them
	ops      []string             // launches, records and waits in call order ("launch e@s", "record e@s", "wait s<-e")

	// Failure injection.
	failBegin        error
	failInstantiate  error
	failDestroyExec  error
	failDestroyGraph error
	failIsCapturing  error
	graphOnEndError  bool // an invalidated end also returns a (partial) graph
	wrongThreadEnd   bool // EndCapture fails with 908 and capture goes on
	failEventCreate  error
	failEventRecord  error
	failStreamWait   error
	failLaunch       error
}

type fakeStream struct {
	status CaptureStatus
	nodes  int
}

func newFake() *fakeDriver {
	return &fakeDriver{
		streams: make(map[uintptr]*fakeStream),
		graphs:  make(map[RawGraph]int),
		execs:   make(map[RawExec]RawGraph),
		events:  make(map[RawEvent]uintptr),
		next:    0x1000,
	}
}

var fakeNames = map[int]struct{ name, msg string }{
	CodeInvalidValue:             {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	CodeIllegalState:             {"CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
	400:                          {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	CodeStreamCaptureInvalidated: {"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
	CodeStreamCaptureWrongThread: {"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
	2:                            {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
}

func fakeErr(op string, code int) *Error {
	n := fakeNames[code]
	return &Error{Op: op, Code: code, Name: n.name, Message: n.msg}
}

func (f *fakeDriver) stream(s uintptr) *fakeStream {
	st := f.streams[s]
	if st == nil {
		st = &fakeStream{}
		f.streams[s] = st
	}
	return st
}

func (f *fakeDriver) newHandle() uintptr {
	f.next += 0x10
	return f.next
}

// record captures one "kernel" on s if it is capturing.
func (f *fakeDriver) record(s uintptr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if st := f.stream(s); st.status == StatusActive {
		st.nodes++
	}
}

// invalidate makes s's capture invalid, as an illegal call during capture does.
func (f *fakeDriver) invalidate(s uintptr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if st := f.stream(s); st.status == StatusActive {
		st.status = StatusInvalidated
	}
}

// beginOutside starts a capture the registry did not begin (torch's own).
func (f *fakeDriver) beginOutside(s uintptr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stream(s).status = StatusActive
}

func (f *fakeDriver) set(fn func(*fakeDriver)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func (f *fakeDriver) counts() (graphs, execs int, misuse []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.graphs), len(f.execs), append([]string(nil), f.misuse...)
}

func (f *fakeDriver) BeginCapture(s uintptr, mode Mode) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failBegin != nil {
		return f.failBegin
	}
	if !mode.Valid() {
		f.misuse = append(f.misuse, fmt.Sprintf("begin with mode %d", mode))
		return fakeErr("cuStreamBeginCapture", CodeInvalidValue)
	}
	st := f.stream(s)
	if st.status != StatusNone {
		return fakeErr("cuStreamBeginCapture", CodeIllegalState)
	}
	st.status, st.nodes = StatusActive, 0
	return nil
}

func (f *fakeDriver) EndCapture(s uintptr) (RawGraph, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.stream(s)
	switch {
	case st.status == StatusNone:
		return 0, fakeErr("cuStreamEndCapture", CodeIllegalState)
	case f.wrongThreadEnd:
		return 0, fakeErr("cuStreamEndCapture", CodeStreamCaptureWrongThread)
	case st.status == StatusInvalidated:
		st.status = StatusNone
		var g RawGraph
		if f.graphOnEndError {
			g = RawGraph(f.newHandle())
			f.graphs[g] = st.nodes
		}
		return g, fakeErr("cuStreamEndCapture", CodeStreamCaptureInvalidated)
	}
	st.status = StatusNone
	g := RawGraph(f.newHandle())
	f.graphs[g] = st.nodes
	return g, nil
}

func (f *fakeDriver) Instantiate(g RawGraph) (RawExec, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.graphs[g]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("instantiate dead graph %#x", g))
		return 0, fakeErr("cuGraphInstantiateWithFlags", 400)
	}
	if f.failInstantiate != nil {
		return 0, f.failInstantiate
	}
	e := RawExec(f.newHandle())
	f.execs[e] = g
	return e, nil
}

func (f *fakeDriver) Launch(e RawExec, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.execs[e]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("launch dead exec %#x", e))
		return fakeErr("cuGraphLaunch", 400)
	}
	if f.failLaunch != nil {
		return f.failLaunch
	}
	f.launches++
	f.ops = append(f.ops, fmt.Sprintf("launch %#x@%#x", e, s))
	return nil
}

func (f *fakeDriver) EventCreate(s uintptr) (RawEvent, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failEventCreate != nil {
		return 0, f.failEventCreate
	}
	ev := RawEvent(f.newHandle())
	f.events[ev] = s
	return ev, nil
}

func (f *fakeDriver) EventRecord(ev RawEvent, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.events[ev]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("record dead event %#x", ev))
		return fakeErr("cuEventRecord", 400)
	}
	if f.failEventRecord != nil {
		return f.failEventRecord
	}
	f.ops = append(f.ops, fmt.Sprintf("record %#x@%#x", ev, s))
	return nil
}

func (f *fakeDriver) StreamWaitEvent(s uintptr, ev RawEvent) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.events[ev]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("wait on dead event %#x", ev))
		return fakeErr("cuStreamWaitEvent", 400)
	}
	if f.failStreamWait != nil {
		return f.failStreamWait
	}
	f.ops = append(f.ops, fmt.Sprintf("wait %#x<-%#x", s, ev))
	return nil
}

// opLog returns the launches, records and waits so far and forgets them.
func (f *fakeDriver) opLog() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	ops := f.ops
	f.ops = nil
	return ops
}

func (f *fakeDriver) Upload(e RawExec, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.execs[e]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("upload dead exec %#x", e))
		return fakeErr("cuGraphUpload", 400)
	}
	f.uploads++
	return nil
}

func (f *fakeDriver) DestroyExec(e RawExec) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.execs[e]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("destroy dead exec %#x", e))
		return fakeErr("cuGraphExecDestroy", 400)
	}
	if f.failDestroyExec != nil {
		return f.failDestroyExec
	}
	delete(f.execs, e)
	return nil
}

func (f *fakeDriver) DestroyGraph(g RawGraph) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.graphs[g]; !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("destroy dead graph %#x", g))
		return fakeErr("cuGraphDestroy", 400)
	}
	if f.failDestroyGraph != nil {
		return f.failDestroyGraph
	}
	delete(f.graphs, g)
	return nil
}

func (f *fakeDriver) IsCapturing(s uintptr) (CaptureStatus, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failIsCapturing != nil {
		return StatusNone, f.failIsCapturing
	}
	return f.stream(s).status, nil
}

func (f *fakeDriver) ExchangeMode(m Mode) (Mode, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	prev := f.mode
	f.mode = m
	return prev, nil
}

func (f *fakeDriver) NodeCount(g RawGraph) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, ok := f.graphs[g]
	if !ok {
		f.misuse = append(f.misuse, fmt.Sprintf("count nodes of dead graph %#x", g))
		return 0, fakeErr("cuGraphGetNodes", 400)
	}
	return n, nil
}

func (f *fakeDriver) DriverVersion() (int, error)          { return 12090, nil }
func (f *fakeDriver) DeviceCount() (int, error)            { return 1, nil }
func (f *fakeDriver) DeviceName(int) (string, error)       { return "Fake GPU", nil }
func (f *fakeDriver) DeviceTotalMemory(int) (int64, error) { return 80 << 30, nil }
