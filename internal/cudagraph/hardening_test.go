package cudagraph

import (
	"strings"
	"sync"
	"testing"
)

// panicky is a Driver over the fake that panics, before delegating, in the
// methods named in on (once each, then it delegates again).
type panicky struct {
	*fakeDriver
	mu sync.Mutex
	on map[string]bool
}

func newPanicky(f *fakeDriver) *panicky { return &panicky{fakeDriver: f, on: map[string]bool{}} }

func (p *panicky) arm(method string) {
	p.mu.Lock()
	p.on[method] = true
	p.mu.Unlock()
}

func (p *panicky) maybe(method string) {
	p.mu.Lock()
	hit := p.on[method]
	delete(p.on, method)
	p.mu.Unlock()
	if hit {
		panic("injected panic in " + method)
	}
}

func (p *panicky) BeginCapture(s uintptr, m Mode) error {
	p.maybe("BeginCapture")
	return p.fakeDriver.BeginCapture(s, m)
}
func (p *panicky) EndCapture(s uintptr) (RawGraph, error) {
	p.maybe("EndCapture")
	return p.fakeDriver.EndCapture(s)
}
func (p *panicky) Instantiate(g RawGraph) (RawExec, error) {
	p.maybe("Instantiate")
	return p.fakeDriver.Instantiate(g)
}
func (p *panicky) Launch(e RawExec, s uintptr) error {
	p.maybe("Launch")
	return p.fakeDriver.Launch(e, s)
}
func (p *panicky) Upload(e RawExec, s uintptr) error {
	p.maybe("Upload")
	return p.fakeDriver.Upload(e, s)
}
func (p *panicky) DestroyExec(e RawExec) error {
	p.maybe("DestroyExec")
	return p.fakeDriver.DestroyExec(e)
}
func (p *panicky) DestroyGraph(g RawGraph) error {
	p.maybe("DestroyGraph")
	return p.fakeDriver.DestroyGraph(g)
}
func (p *panicky) IsCapturing(s uintptr) (CaptureStatus, error) {
	p.maybe("IsCapturing")
	return p.fakeDriver.IsCapturing(s)
}
func (p *panicky) ExchangeMode(m Mode) (Mode, error) {
	p.maybe("ExchangeMode")
	return p.fakeDriver.ExchangeMode(m)
}
func (p *panicky) NodeCount(g RawGraph) (int, error) {
	p.maybe("NodeCount")
	return p.fakeDriver.NodeCount(g)
}

func (p *panicky) EventCreate(s uintptr) (RawEvent, error) {
	p.maybe("EventCreate")
	return p.fakeDriver.EventCreate(s)
}
func (p *panicky) EventRecord(ev RawEvent, s uintptr) error {
	p.maybe("EventRecord")
	return p.fakeDriver.EventRecord(ev, s)
}
func (p *panicky) StreamWaitEvent(s uintptr, ev RawEvent) error {
	p.maybe("StreamWaitEvent")
	return p.fakeDriver.StreamWaitEvent(s, ev)
}

var panickyMethods = []string{"BeginCapture", "EndCapture", "Instantiate", "Launch", "Upload", "DestroyExec",
	"DestroyGraph", "IsCapturing", "ExchangeMode", "NodeCount"}

// TestDriverPanicIsAnError: a panic in each driver method comes back as that
// operation's error (prefixed with its Python name, carrying a *PanicError),
// never as a panic, and the registry stays usable: the stream can capture
// again and nothing is left registered.
func TestDriverPanicIsAnError(t *testing.T) {
	for _, method := range panickyMethods {
		t.Run(method, func(t *testing.T) {
			f := newFake()
			p := newPanicky(f)
			r := NewRegistry(p)
			h := capture(t, r, f, stream, 2) // one good graph to launch/upload/destroy
			p.arm(method)
			var errs []error
			if err := r.BeginCapture(stream, 0); err == nil {
				f.record(streamHandle(stream))
				_, err = r.EndCapture(stream)
				errs = append(errs, err)
			} else {
				errs = append(errs, err)
			}
			errs = append(errs, r.Launch(h, stream), r.Upload(h, stream))
			_, err := r.NodeCount(h)
			errs = append(errs, err)
			_, err = r.CaptureStatus(stream)
			errs = append(errs, err)
			_, err = r.ExchangeCaptureMode(0)
			errs = append(errs, err)
			errs = append(errs, r.AbortCapture(stream), r.Destroy(h))
			found := false
			for _, err := range errs {
				if err != nil && strings.Contains(err.Error(), "internal panic") {
					found = true
					var pe *PanicError
					if !asPanic(err, &pe) || pe.Op != method {
						t.Errorf("error %q does not carry a PanicError for %s", err, method)
					}
				}
			}
			if !found {
				t.Fatalf("the injected panic in %s was not reported: %v", method, errs)
			}
			// Usable afterwards, and clean once everything is destroyed.
			_ = r.AbortCapture(stream)
			for _, id := range liveHandles(r) {
				_ = r.Destroy(id)
			}
			h2 := capture(t, r, f, stream, 1)
			if err := r.Launch(h2, stream); err != nil {
				t.Fatal(err)
			}
			if err := r.Destroy(h2); err != nil {
				t.Fatal(err)
			}
			if r.Capturing() != 0 || r.LiveGraphs() != 0 {
				t.Fatalf("capturing %d, live graphs %d", r.Capturing(), r.LiveGraphs())
			}
			_, _, misuse := f.counts()
			if len(misuse) != 0 {
				t.Fatalf("driver misuse: %v", misuse)
			}
		})
	}
}

// TestBeginPanicDoesNotWedgeTheStream is the failure the driver-boundary
// recovery exists for: a panic inside the driver's begin used to unwind past
// the registry and leave the stream marked "begin_capture in progress"
// forever, refusing every later capture on it.
func TestBeginPanicDoesNotWedgeTheStream(t *testing.T) {
	f := newFake()
	p := newPanicky(f)
	r := NewRegistry(p)
	p.arm("BeginCapture")
	if err := r.BeginCapture(stream, 0); err == nil || !strings.Contains(err.Error(), "begin_capture: driver BeginCapture: internal panic: injected panic") {
		t.Fatalf("BeginCapture: %v", err)
	}
	if r.Capturing() != 0 {
		t.Fatal("stream left marked capturing after a panicking begin")
	}
	h := capture(t, r, f, stream, 1)
	p.arm("EndCapture")
	if err := r.BeginCapture(stream, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := r.EndCapture(stream); err == nil || !strings.Contains(err.Error(), "internal panic") {
		t.Fatalf("EndCapture: %v", err)
	}
	// The stream is still capturing in the driver (the panic came before the
	// driver's end): it stays ours, so abort can end it.
	if err := r.AbortCapture(stream); err != nil {
		t.Fatalf("AbortCapture after a panicking end: %v", err)
	}
	must(t, r.Destroy(h))
	checkClean(t, r, f)
}

func asPanic(err error, target **PanicError) bool {
	for err != nil {
		if pe, ok := err.(*PanicError); ok {
			*target = pe
			return true
		}
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			if m, ok := err.(interface{ Unwrap() []error }); ok {
				for _, e := range m.Unwrap() {
					if asPanic(e, target) {
						return true
					}
				}
			}
			return false
		}
		err = u.Unwrap()
	}
	return false
}

// liveHandles lists the registry's registered handles.
func liveHandles(r *Registry) []int64 {
	r.graphMu.RLock()
	defer r.graphMu.RUnlock()
	ids := make([]int64, 0, len(r.graphs))
	for id := range r.graphs {
		ids = append(ids, id)
	}
	return ids
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// FuzzRegistry runs a byte-coded sequence of operations on a registry over
// the fake driver, with failure and panic injection, on three streams (one of
// them sometimes captured "outside" gograph, as torch.cuda.graph would).
// Invariants: nothing panics; every error names its operation; the driver is
// never asked to use a freed or unknown object; once injection stops and
// every stream is aborted and every handle destroyed, nothing is left
// registered or capturing, and the driver holds no object except those whose
// destruction was made to fail.
func FuzzRegistry(f *testing.F) {
	f.Add([]byte{0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 6, 0})
	f.Add([]byte{0, 1, 5, 1, 2, 1, 0, 1, 9, 1, 2, 1, 3, 1, 7, 0})
	f.Add([]byte{10, 0, 0, 2, 1, 2, 12, 2, 2, 2, 11, 3, 3, 0, 6, 0, 13, 4, 0, 0, 2, 0})
	f.Add([]byte{14, 0, 0, 0, 14, 1, 2, 0, 0, 0, 2, 0, 14, 2, 3, 1, 14, 5, 6, 1, 6, 2})
	f.Fuzz(func(t *testing.T, data []byte) {
		fd := newFake()
		p := newPanicky(fd)
		r := NewRegistry(p)
		streams := [3]int64{0x7000_1000, 0x7000_2000, 0x7000_3000}
		var handles []int64
		allowedLeaks := 0
		destroyFailing := false
		prefixOK := func(op string, err error) {
			if err != nil && !strings.HasPrefix(err.Error(), op+": ") {
				t.Fatalf("%s error without its name: %v", op, err)
			}
		}
		pick := func(b byte) int64 {
			if len(handles) == 0 || b%5 == 0 {
				return int64(b) // unknown or stale handle
			}
			return handles[int(b)%len(handles)]
		}
		for i := 0; i+1 < len(data); i += 2 {
			op, arg := data[i]%16, data[i+1]
			s := streams[int(arg)%len(streams)]
			switch op {
			case 0:
				err := r.BeginCapture(s, int(arg/3)%4) // mode 3 is invalid
				prefixOK("begin_capture", err)
			case 1:
				fd.record(streamHandle(s))
			case 2:
				if destroyFailing {
					allowedLeaks += 2
				}
				h, err := r.EndCapture(s)
				prefixOK("end_capture", err)
				if err == nil {
					if h <= 0 {
						t.Fatalf("end_capture returned handle %d", h)
					}
					handles = append(handles, h)
				} else if h != 0 {
					t.Fatalf("end_capture returned handle %d with an error", h)
				}
			case 3:
				if destroyFailing {
					allowedLeaks += 2
				}
				prefixOK("abort_capture", r.AbortCapture(s))
			case 4:
				prefixOK("launch_graph", r.Launch(pick(arg), s))
			case 5:
				prefixOK("upload_graph", r.Upload(pick(arg), s))
			case 6:
				if destroyFailing {
					allowedLeaks += 2
				}
				prefixOK("destroy_graph", r.Destroy(pick(arg)))
			case 7:
				_, err := r.NodeCount(pick(arg))
				prefixOK("graph_node_count", err)
			case 8:
				_, err := r.CaptureStatus(s)
				prefixOK("capture_status", err)
			case 9:
				fd.invalidate(streamHandle(s))
			case 10:
				fd.beginOutside(streamHandle(s))
			case 11:
				_, err := r.ExchangeCaptureMode(int(arg) % 4)
				prefixOK("exchange_capture_mode", err)
			case 12: // toggle a driver failure
				fd.set(func(fd *fakeDriver) {
					switch arg % 6 {
					case 0:
						fd.failInstantiate = toggle(fd.failInstantiate, fakeErr("cuGraphInstantiateWithFlags", 2))
					case 1:
						fd.failDestroyExec = toggle(fd.failDestroyExec, fakeErr("cuGraphExecDestroy", CodeIllegalState))
					case 2:
						fd.failDestroyGraph = toggle(fd.failDestroyGraph, fakeErr("cuGraphDestroy", CodeIllegalState))
					case 3:
						fd.graphOnEndError = !fd.graphOnEndError
					case 4:
						fd.wrongThreadEnd = !fd.wrongThreadEnd
					case 5:
						fd.failBegin = toggle(fd.failBegin, fakeErr("cuStreamBeginCapture", 2))
					}
					destroyFailing = fd.failDestroyExec != nil || fd.failDestroyGraph != nil
				})
			case 13: // IsCapturing failing makes abort and settle take their error paths
				fd.set(func(fd *fakeDriver) {
					fd.failIsCapturing = toggle(fd.failIsCapturing, fakeErr("cuStreamIsCapturing", 400))
				})
			case 14: // the next call of one driver method panics
				p.arm(panickyMethods[int(arg)%len(panickyMethods)])
				if m := panickyMethods[int(arg)%len(panickyMethods)]; m == "DestroyExec" || m == "DestroyGraph" {
					allowedLeaks += 2 // a panicking destroy frees nothing
				}
			case 15:
				_ = r.LiveGraphs()
				_ = r.Capturing()
			}
			if _, _, misuse := fd.counts(); len(misuse) > 0 {
				t.Fatalf("driver misuse after op %d: %v", op, misuse)
			}
		}
		// Stop injecting, then clean up everything.
		p.mu.Lock()
		p.on = map[string]bool{}
		p.mu.Unlock()
		fd.set(func(fd *fakeDriver) {
			fd.failBegin, fd.failInstantiate, fd.failDestroyExec, fd.failDestroyGraph, fd.failIsCapturing = nil, nil, nil, nil, nil
			fd.wrongThreadEnd, fd.graphOnEndError = false, false
		})
		for _, s := range streams {
			if err := r.AbortCapture(s); err != nil {
				t.Fatalf("final abort_capture: %v", err)
			}
		}
		for _, id := range liveHandles(r) {
			if err := r.Destroy(id); err != nil {
				t.Fatalf("final destroy: %v", err)
			}
		}
		if r.Capturing() != 0 || r.LiveGraphs() != 0 {
			t.Fatalf("capturing %d, live graphs %d after cleanup", r.Capturing(), r.LiveGraphs())
		}
		g, e, misuse := fd.counts()
		if len(misuse) > 0 {
			t.Fatalf("driver misuse: %v", misuse)
		}
		if g+e > allowedLeaks {
			t.Fatalf("driver holds %d graphs and %d execs after cleanup (allowed by injected destroy failures: %d)", g, e, allowedLeaks)
		}
	})
}

func toggle(cur error, e *Error) error {
	if cur != nil {
		return nil
	}
	return e
}
