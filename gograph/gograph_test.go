//go:build !cuda

// These tests exercise the cpu flavor, the one built everywhere: capture
// calls fail with the no-CUDA error, pass records work with eager (0) graph
// handles, and panics come back as errors.

package gograph

import (
	"strconv"
	"strings"
	"testing"
)

const noCUDA = "gograph core was built without CUDA support (cpu flavor)"

// errOf keeps the error of an export's (ok, err) result.
func errOf(_ bool, err error) error { return err }

func TestBuildInfo(t *testing.T) {
	if v := CoreVersion(); v != "0.3.0" {
		t.Errorf("CoreVersion = %q", v)
	}
	if f := Flavor(); f != "cpu" {
		t.Errorf("Flavor = %q", f)
	}
	if v := CudaHeaderVersion(); v != 0 {
		t.Errorf("CudaHeaderVersion = %d", v)
	}
}

func TestCaptureCallsNeedCUDA(t *testing.T) {
	const s = 0x55550000
	errs := map[string]error{}
	_, errs["driver_version"] = DriverVersion()
	_, errs["device_count"] = DeviceCount()
	_, errs["device_name"] = DeviceName(0)
	_, errs["device_total_memory"] = DeviceTotalMemory(0)
	errs["begin_capture"] = errOf(BeginCapture(s, 0))
	_, errs["capture_status"] = CaptureStatus(s)
	_, errs["exchange_capture_mode"] = ExchangeCaptureMode(1)
	errs["abort_capture"] = errOf(AbortCapture(s))
	for name, err := range errs {
		if want := name + ": " + noCUDA; err == nil || err.Error() != want {
			t.Errorf("%s: got %v, want %q", name, err, want)
		}
	}
	// Argument checks come first, so their messages are the same in both flavors.
	if _, err := BeginCapture(0, 0); err == nil || !strings.Contains(err.Error(), "refusing to capture the legacy default stream (0)") {
		t.Errorf("BeginCapture(0): %v", err)
	}
	if _, err := EndCapture(s); err == nil || !strings.Contains(err.Error(), "is not capturing through gograph") {
		t.Errorf("EndCapture: %v", err)
	}
	launched, launchErr := LaunchGraph(1, s)
	if launched {
		t.Error("LaunchGraph of an unknown handle reported a launch")
	}
	for name, err := range map[string]error{
		"launch_graph":  launchErr,
		"upload_graph":  errOf(UploadGraph(1, s)),
		"destroy_graph": errOf(DestroyGraph(1)),
	} {
		if err == nil || !strings.HasPrefix(err.Error(), name+": unknown graph handle 1") {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := GraphNodeCount(1); err == nil {
		t.Error("GraphNodeCount of an unknown handle succeeded")
	}
	if n := LiveGraphs(); n != 0 {
		t.Errorf("LiveGraphs = %d", n)
	}
}

func TestEagerPassLifecycle(t *testing.T) {
	before := LivePasses()
	p, err := NewPass(3, "layer3")
	if err != nil || p <= 0 {
		t.Fatalf("NewPass = %d, %v", p, err)
	}
	for kind := 0; kind < 2; kind++ { // the capture transaction, eager: stream 0
		if _, err := BeginPassCapture(p, kind, "eager/1", 0, 0); err != nil {
			t.Fatal(err)
		}
		if seq, err := EndPassCapture(p, kind, 0); seq != kind+1 || err != nil {
			t.Fatalf("EndPassCapture = %d, %v", seq, err)
		}
	}
	if n := PoolRefs("eager/1"); n != 2 {
		t.Fatalf("PoolRefs = %d, want 2", n)
	}
	if _, err := SealPass(p); err != nil {
		t.Fatal(err)
	}
	for _, k := range []int{0, 1} {
		if launched, err := Replay(p, k, 0); launched || err != nil { // eager: nothing to launch
			t.Fatalf("Replay(%d) = %v, %v", k, launched, err)
		}
	}
	if _, err := Replay(p, 2, 0); err == nil || err.Error() != `graphed callable 3 ("layer3") has no wgrad graph` {
		t.Fatalf("Replay(wgrad): %v", err)
	}
	if s, err := PassState(p); s != "ready" || err != nil {
		t.Fatalf("PassState = %q, %v", s, err)
	}
	if g, err := PassGraph(p, 0); g != 0 || err != nil {
		t.Fatalf("PassGraph = %d, %v", g, err)
	}
	if n := LivePasses(); n != before+1 {
		t.Fatalf("LivePasses = %d, want %d", n, before+1)
	}
	if refs, err := ResetPass(p); refs != 2 || err != nil || PoolRefs("eager/1") != 0 {
		t.Fatalf("ResetPass = %d, %v (pool left %d)", refs, err, PoolRefs("eager/1"))
	}
	if msg, err := PassResetError(p); msg != "" || err != nil {
		t.Fatalf("PassResetError = %q, %v", msg, err)
	}
	if refs, err := ResetPass(p); refs != 0 || err != nil {
		t.Fatalf("second ResetPass = %d, %v", refs, err)
	}
	const resetMsg = `graphed callable 3 ("layer3") was reset; call make_graphed_callables again to graph it anew`
	if _, err := Replay(p, 0, 0); err == nil || err.Error() != resetMsg {
		t.Fatalf("Replay after reset: %v", err)
	}
	if s, _ := PassState(p); s != "reset" {
		t.Fatalf("PassState = %q", s)
	}
	if _, err := DropPass(p); err != nil {
		t.Fatal(err)
	}
	if _, err := DropPass(p); err != nil { // finalizer after an explicit drop
		t.Fatal(err)
	}
	if _, err := PassState(p); err == nil || err.Error() != "unknown pass "+strconv.FormatInt(p, 10) {
		t.Fatalf("PassState after drop: %v", err)
	}
	if n := LivePasses(); n != before {
		t.Fatalf("LivePasses = %d, want %d", n, before)
	}
}

func TestPassErrors(t *testing.T) {
	p, _ := NewPass(0, "fc")
	defer DropPass(p)
	if _, err := Replay(p, 0, 0); err == nil || err.Error() != `graphed callable 0 ("fc") is still being captured` {
		t.Fatalf("Replay while building: %v", err)
	}
	if _, err := BeginPassCapture(p, 5, "x", 0, 0); err == nil || err.Error() != "begin_pass_capture: unknown graph kind 5 (want 0 forward, 1 backward or 2 wgrad)" {
		t.Fatalf("BeginPassCapture(kind 5): %v", err)
	}
	if _, err := EndPassCapture(p, 0, 0); err == nil || !strings.Contains(err.Error(), "end_pass_capture: graphed callable 0 (\"fc\") has no forward capture open") {
		t.Fatalf("EndPassCapture without begin: %v", err)
	}
	// In the cpu flavor a capture on a real stream fails at the driver, and changes nothing.
	if _, err := BeginPassCapture(p, 0, "x", 0x5555, 0); err == nil || !strings.Contains(err.Error(), noCUDA) || PoolRefs("x") != 0 {
		t.Fatalf("BeginPassCapture on a stream without CUDA: %v (pool refs %d)", err, PoolRefs("x"))
	}
	if _, err := SealPass(-7); err == nil || err.Error() != "unknown pass -7" {
		t.Fatalf("SealPass(-7): %v", err)
	}
	if _, err := NewPass(-1, "x"); err == nil {
		t.Fatal("NewPass(-1) succeeded")
	}
}

func TestPanicBecomesError(t *testing.T) {
	ok, err := TriggerPanicForTest()
	if ok || err == nil || !strings.HasPrefix(err.Error(), "trigger_panic_for_test: internal panic: ") {
		t.Fatalf("TriggerPanicForTest = %v", err)
	}
	// A runtime error (not only an explicit panic) is recovered the same way.
	f := func() (err error) {
		defer recoverPanic("f", &err)
		var m map[int]int
		m[0] = 1 //lint:ignore SA5000 the deliberate runtime panic under test
		return nil
	}
	if err := f(); err == nil || !strings.Contains(err.Error(), "f: internal panic: assignment to entry in nil map") {
		t.Fatalf("runtime panic: %v", err)
	}
}
