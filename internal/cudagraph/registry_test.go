package cudagraph

import (
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"
)

const stream = int64(0x7f00_0000_1000) // looks like a torch cuda_stream value

// checkClean fails the test if the registry or the fake holds anything:
// registered graphs, streams marked capturing, live driver objects, misuse.
func checkClean(t *testing.T, r *Registry, f *fakeDriver) {
	t.Helper()
	if n := r.LiveGraphs(); n != 0 {
		t.Errorf("LiveGraphs = %d, want 0", n)
	}
	if n := r.Capturing(); n != 0 {
		t.Errorf("Capturing = %d, want 0", n)
	}
	g, e, misuse := f.counts()
	if g != 0 || e != 0 {
		t.Errorf("driver holds %d graphs and %d execs, want none (leak)", g, e)
	}
	if len(misuse) != 0 {
		t.Errorf("driver misuse: %v", misuse)
	}
}

func wantErr(t *testing.T, err error, want string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %q", want)
	}
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not contain %q", err, want)
	}
}

func capture(t *testing.T, r *Registry, f *fakeDriver, s int64, kernels int) int64 {
	t.Helper()
	if err := r.BeginCapture(s, int(ModeGlobal)); err != nil {
		t.Fatalf("BeginCapture: %v", err)
	}
	for i := 0; i < kernels; i++ {
		f.record(streamHandle(s))
	}
	h, err := r.EndCapture(s)
	if err != nil {
		t.Fatalf("EndCapture: %v", err)
	}
	return h
}

func TestLifecycle(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)

	h1 := capture(t, r, f, stream, 3)
	h2 := capture(t, r, f, stream, 5)
	if h1 != 1 || h2 != 2 {
		t.Fatalf("handles = %d, %d; want 1, 2", h1, h2)
	}
	if n := r.LiveGraphs(); n != 2 {
		t.Fatalf("LiveGraphs = %d, want 2", n)
	}
	if n, err := r.NodeCount(h2); err != nil || n != 5 {
		t.Fatalf("NodeCount = %d, %v; want 5", n, err)
	}
	if err := r.Upload(h1, stream); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if err := r.Launch(h1, stream); err != nil {
			t.Fatal(err)
		}
	}
	if f.launches != 3 || f.uploads != 1 {
		t.Fatalf("launches, uploads = %d, %d; want 3, 1", f.launches, f.uploads)
	}
	if err := r.Destroy(h1); err != nil {
		t.Fatal(err)
	}
	// A destroyed handle is unknown everywhere and never reused.
	wantErr(t, r.Destroy(h1), "destroy_graph: unknown graph handle 1 (never created or already destroyed)")
	wantErr(t, r.Launch(h1, stream), "launch_graph: unknown graph handle 1")
	wantErr(t, r.Upload(h1, stream), "upload_graph: unknown graph handle 1")
	_, err := r.NodeCount(h1)
	wantErr(t, err, "graph_node_count: unknown graph handle 1")
	if h3 := capture(t, r, f, stream, 1); h3 != 3 {
		t.Fatalf("third handle = %d, want 3 (handles are never reused)", h3)
	}
	for _, h := range []int64{h2, 3} {
		if err := r.Destroy(h); err != nil {
			t.Fatal(err)
		}
	}
	wantErr(t, r.Destroy(0), "unknown graph handle 0")
	checkClean(t, r, f)
}

func TestBeginRefusals(t *testing.T) {
	tests := []struct {
		name   string
		stream int64
		mode   int
		setup  func(*Registry, *fakeDriver)
		want   string
	}{
		{"legacy default stream", 0, 0, nil,
			"begin_capture: refusing to capture the legacy default stream (0): capture on a side stream such as torch.cuda.Stream()"},
		{"negative mode", stream, -1, nil, "begin_capture: unknown capture mode -1 (want 0 global, 1 thread_local or 2 relaxed)"},
		{"mode 3", stream, 3, nil, "begin_capture: unknown capture mode 3"},
		{"already capturing through us", stream, 0,
			func(r *Registry, _ *fakeDriver) { _ = r.BeginCapture(stream, 1) },
			fmt.Sprintf("begin_capture: stream %d is already capturing through gograph (capture active); end_capture or abort_capture it first", stream)},
		{"driver refuses", stream, 0,
			func(_ *Registry, f *fakeDriver) { f.beginOutside(streamHandle(stream)) },
			"begin_capture: cuStreamBeginCapture: CUDA_ERROR_ILLEGAL_STATE (401)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake()
			r := NewRegistry(f)
			if tc.setup != nil {
				tc.setup(r, f)
			}
			before := r.Capturing()
			wantErr(t, r.BeginCapture(tc.stream, tc.mode), tc.want)
			if after := r.Capturing(); after != before {
				t.Fatalf("a refused begin changed the capturing set: %d -> %d", before, after)
			}
		})
	}
}

func TestBeginFailureReleasesStream(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)
	f.set(func(f *fakeDriver) { f.failBegin = fakeErr("cuStreamBeginCapture", 2) })
	wantErr(t, r.BeginCapture(stream, 0), "begin_capture: cuStreamBeginCapture: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory")
	f.set(func(f *fakeDriver) { f.failBegin = nil })
	h := capture(t, r, f, stream, 1) // the stream was not left reserved
	if err := r.Destroy(h); err != nil {
		t.Fatal(err)
	}
	checkClean(t, r, f)
}

func TestEndWithoutBegin(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)
	_, err := r.EndCapture(stream)
	wantErr(t, err, fmt.Sprintf("end_capture: stream %d is not capturing through gograph; call begin_capture first", stream))
	// A capture someone else began is not ours to end either.
	f.beginOutside(streamHandle(stream))
	_, err = r.EndCapture(stream)
	wantErr(t, err, "is not capturing through gograph")
	// End twice.
	g := newFake()
	r = NewRegistry(g)
	h := capture(t, r, g, stream, 1)
	_, err = r.EndCapture(stream)
	wantErr(t, err, "is not capturing through gograph")
	_ = r.Destroy(h)
	checkClean(t, r, g)
}

func TestInvalidatedCapture(t *testing.T) {
	for _, partial := range []bool{false, true} {
		t.Run(fmt.Sprintf("graphOnError=%v", partial), func(t *testing.T) {
			f := newFake()
			f.graphOnEndError = partial
			r := NewRegistry(f)
			if err := r.BeginCapture(stream, 0); err != nil {
				t.Fatal(err)
			}
			f.record(streamHandle(stream))
			f.invalidate(streamHandle(stream))
			h, err := r.EndCapture(stream)
			if h != 0 {
				t.Fatalf("handle %d returned for an invalidated capture", h)
			}
			const want = "end_capture: cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901): operation failed due to a previous error during capture"
			if err == nil || err.Error() != want {
				t.Fatalf("err = %v\nwant %s", err, want)
			}
			if ErrorCode(err) != CodeStreamCaptureInvalidated {
				t.Fatalf("ErrorCode = %d, want 901", ErrorCode(err))
			}
			checkClean(t, r, f)
			// The stream is usable again.
			if err := r.Destroy(capture(t, r, f, stream, 1)); err != nil {
				t.Fatal(err)
			}
			checkClean(t, r, f)
		})
	}
}

func TestInstantiateFailureDoesNotLeak(t *testing.T) {
	f := newFake()
	f.failInstantiate = fakeErr("cuGraphInstantiateWithFlags", 2)
	r := NewRegistry(f)
	if err := r.BeginCapture(stream, 0); err != nil {
		t.Fatal(err)
	}
	h, err := r.EndCapture(stream)
	wantErr(t, err, "end_capture: cuGraphInstantiateWithFlags: CUDA_ERROR_OUT_OF_MEMORY (2)")
	if h != 0 {
		t.Fatalf("handle = %d, want 0", h)
	}
	checkClean(t, r, f)

	// A failing cleanup is reported alongside the failure that mattered.
	f.failDestroyGraph = fakeErr("cuGraphDestroy", CodeIllegalState)
	_ = r.BeginCapture(stream, 0)
	_, err = r.EndCapture(stream)
	wantErr(t, err, "end_capture: cuGraphInstantiateWithFlags: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory; then cuGraphDestroy: CUDA_ERROR_ILLEGAL_STATE (401)")
	if r.LiveGraphs() != 0 || r.Capturing() != 0 {
		t.Fatal("failed end left state behind")
	}
}

func TestWrongThreadEndKeepsStream(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)
	if err := r.BeginCapture(stream, int(ModeThreadLocal)); err != nil {
		t.Fatal(err)
	}
	f.set(func(f *fakeDriver) { f.wrongThreadEnd = true })
	_, err := r.EndCapture(stream)
	wantErr(t, err, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD (908)")
	// Still capturing, and still ours: a second begin is refused, and the
	// capture can be ended properly later.
	wantErr(t, r.BeginCapture(stream, 0), "already capturing through gograph")
	f.set(func(f *fakeDriver) { f.wrongThreadEnd = false })
	h, err := r.EndCapture(stream)
	if err != nil {
		t.Fatal(err)
	}
	_ = r.Destroy(h)
	checkClean(t, r, f)
}

func TestAbortCapture(t *testing.T) {
	tests := []struct {
		name  string
		setup func(*Registry, *fakeDriver)
	}{
		{"nothing capturing", func(*Registry, *fakeDriver) {}},
		{"active", func(r *Registry, f *fakeDriver) {
			_ = r.BeginCapture(stream, 0)
			f.record(streamHandle(stream))
		}},
		{"invalidated", func(r *Registry, f *fakeDriver) {
			_ = r.BeginCapture(stream, 0)
			f.invalidate(streamHandle(stream))
		}},
		{"invalidated with partial graph", func(r *Registry, f *fakeDriver) {
			f.graphOnEndError = true
			_ = r.BeginCapture(stream, 0)
			f.invalidate(streamHandle(stream))
		}},
		{"begun outside gograph", func(_ *Registry, f *fakeDriver) { f.beginOutside(streamHandle(stream)) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake()
			r := NewRegistry(f)
			tc.setup(r, f)
			if err := r.AbortCapture(stream); err != nil {
				t.Fatalf("AbortCapture: %v", err)
			}
			if st, _ := r.CaptureStatus(stream); st != int(StatusNone) {
				t.Fatalf("status after abort = %d", st)
			}
			if err := r.AbortCapture(stream); err != nil { // harmless twice
				t.Fatal(err)
			}
			checkClean(t, r, f)
		})
	}
	t.Run("legacy stream", func(t *testing.T) {
		if err := NewRegistry(newFake()).AbortCapture(0); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("status query fails", func(t *testing.T) {
		f := newFake()
		r := NewRegistry(f)
		_ = r.BeginCapture(stream, 0)
		f.set(func(f *fakeDriver) { f.failIsCapturing = fakeErr("cuStreamIsCapturing", 400) })
		wantErr(t, r.AbortCapture(stream), "abort_capture: cuStreamIsCapturing: CUDA_ERROR_INVALID_HANDLE (400)")
		// Still ours, so the abort can be retried.
		f.set(func(f *fakeDriver) { f.failIsCapturing = nil })
		wantErr(t, r.BeginCapture(stream, 0), "already capturing")
		if err := r.AbortCapture(stream); err != nil {
			t.Fatal(err)
		}
		checkClean(t, r, f)
	})
}

func TestStatusAndMode(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)
	if st, err := r.CaptureStatus(stream); err != nil || st != 0 {
		t.Fatalf("status = %d, %v", st, err)
	}
	_ = r.BeginCapture(stream, 0)
	if st, _ := r.CaptureStatus(stream); st != 1 {
		t.Fatalf("status = %d, want 1", st)
	}
	f.invalidate(streamHandle(stream))
	if st, _ := r.CaptureStatus(stream); st != 2 {
		t.Fatalf("status = %d, want 2", st)
	}
	_ = r.AbortCapture(stream)

	if prev, err := r.ExchangeCaptureMode(2); err != nil || prev != 0 {
		t.Fatalf("exchange = %d, %v", prev, err)
	}
	if prev, err := r.ExchangeCaptureMode(1); err != nil || prev != 2 {
		t.Fatalf("exchange = %d, %v", prev, err)
	}
	_, err := r.ExchangeCaptureMode(7)
	wantErr(t, err, "exchange_capture_mode: unknown capture mode 7")
	checkClean(t, r, f)
}

func TestDestroyFailureStillUnregisters(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)
	h := capture(t, r, f, stream, 1)
	f.set(func(f *fakeDriver) { f.failDestroyExec = fakeErr("cuGraphExecDestroy", CodeIllegalState) })
	wantErr(t, r.Destroy(h), "destroy_graph: cuGraphExecDestroy: CUDA_ERROR_ILLEGAL_STATE (401)")
	if r.LiveGraphs() != 0 {
		t.Fatal("a graph whose destroy failed is still registered")
	}
	wantErr(t, r.Destroy(h), "unknown graph handle")
	if g, _, misuse := f.counts(); g != 0 || len(misuse) != 0 {
		t.Fatalf("graph not freed after exec destroy failed (graphs %d, misuse %v)", g, misuse)
	}
}

func TestErrorText(t *testing.T) {
	err := error(&Error{Op: "cuStreamEndCapture", Code: 901, Name: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
		Message: "operation failed due to a previous error during capture"})
	const want = "cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901): operation failed due to a previous error during capture"
	if err.Error() != want {
		t.Fatalf("got %q", err)
	}
	if ErrorCode(fmt.Errorf("end_capture: %w", err)) != 901 || ErrorCode(errors.New("x")) != 0 {
		t.Fatal("ErrorCode does not see through wrapping")
	}
}

// TestConcurrent hammers one registry from many goroutines: each captures,
// launches and destroys on its own stream, while others launch and destroy
// random handles and begin/abort a shared stream. Run with -race; the fake
// records any call on a freed handle as misuse.
func TestConcurrent(t *testing.T) {
	f := newFake()
	r := NewRegistry(f)
	const workers, rounds = 16, 200
	var wg sync.WaitGroup
	shared := int64(0xdead0)
	for w := 0; w < workers; w++ {
		wg.Add(3)
		go func(w int) { // owner: full lifecycle on a private stream
			defer wg.Done()
			s := int64(w+1) << 20
			for i := 0; i < rounds; i++ {
				if err := r.BeginCapture(s, w%3); err != nil {
					t.Error(err)
					return
				}
				f.record(streamHandle(s))
				h, err := r.EndCapture(s)
				if err != nil {
					t.Error(err)
					return
				}
				_ = r.Upload(h, s)
				_ = r.Launch(h, s)
				if _, err := r.NodeCount(h); err != nil && !strings.Contains(err.Error(), "unknown graph handle") {
					t.Error(err)
				}
				// Another goroutine may have destroyed it already.
				if err := r.Destroy(h); err != nil && !strings.Contains(err.Error(), "unknown graph handle") {
					t.Error(err)
				}
			}
		}(w)
		go func(w int) { // vandal: launch and destroy whatever handles exist
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(w)))
			for i := 0; i < rounds; i++ {
				h := int64(rng.Intn(workers*rounds) + 1)
				_ = r.Launch(h, 1)
				if rng.Intn(4) == 0 {
					_ = r.Destroy(h)
				}
				_ = r.LiveGraphs()
			}
		}(w)
		go func() { // contender: begin/abort on one shared stream
			defer wg.Done()
			for i := 0; i < rounds; i++ {
				if err := r.BeginCapture(shared, 0); err == nil {
					_, _ = r.CaptureStatus(shared)
					if i%2 == 0 {
						_ = r.AbortCapture(shared)
					} else if h, err := r.EndCapture(shared); err == nil {
						_ = r.Destroy(h)
					} else {
						_ = r.AbortCapture(shared)
					}
				}
			}
		}()
	}
	wg.Wait()
	_ = r.AbortCapture(shared)
	checkClean(t, r, f)
}
