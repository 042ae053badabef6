package gograph

// Hardening of the exported surface (both flavors): static rules every
// export must follow, checked on the source so that functions added later are
// held to them too, and runtime proof that panics anywhere under an export
// come back as errors.

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/gograph/gograph/internal/cudagraph"
	"github.com/gograph/gograph/internal/state"
)

// gopyName is the Python name gopy -rename=true gives a Go function.
func gopyName(goName string) string {
	var b strings.Builder
	rs := []rune(goName)
	for i, r := range rs {
		if unicode.IsUpper(r) {
			if i > 0 && (unicode.IsLower(rs[i-1]) || (i+1 < len(rs) && unicode.IsLower(rs[i+1]))) {
				b.WriteByte('_')
			}
			b.WriteRune(unicode.ToLower(r))
		} else {
			b.WriteRune(r)
		}
	}
	return b.String()
}

// crossable are the only types allowed in an export's signature: scalars and
// strings gopy converts by value, and error (a RuntimeError in Python). No
// func parameters means no Go->Python callbacks; no slices, maps, pointers,
// structs or interfaces means no objects shared across the boundary.
var crossable = map[string]bool{"int": true, "int64": true, "string": true, "bool": true, "float64": true, "error": true}

// exports parses the package's non-test sources and returns its exported
// top-level functions.
func exports(t *testing.T) []*ast.FuncDecl {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var out []*ast.FuncDecl
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if ok && fd.Recv == nil && fd.Name.IsExported() {
				out = append(out, fd)
			}
		}
	}
	if len(out) < 20 {
		t.Fatalf("found only %d exported functions; is the test running in the package directory?", len(out))
	}
	return out
}

func typeName(e ast.Expr) string {
	if id, ok := e.(*ast.Ident); ok {
		return id.Name
	}
	return "non-identifier type"
}

// TestExportRules: every export takes and returns only crossable types;
// none returns an error alone (gopy leaks a C string per call for that
// shape); every export with an error result starts with
// `defer recoverPanic("<its python name>", &<its error result>)`; one
// without an error result is a single return statement (nothing that can
// panic beyond what it returns).
func TestExportRules(t *testing.T) {
	for _, fd := range exports(t) {
		name := fd.Name.Name
		for _, field := range fd.Type.Params.List {
			if tn := typeName(field.Type); !crossable[tn] {
				t.Errorf("%s: parameter of type %s cannot cross the gopy boundary (allowed: int, int64, string, bool, float64)", name, tn)
			}
		}
		var results []*ast.Field
		if fd.Type.Results != nil {
			results = fd.Type.Results.List
		}
		nres, errName := 0, ""
		for _, field := range results {
			n := len(field.Names)
			if n == 0 {
				n = 1
			}
			nres += n
			tn := typeName(field.Type)
			if !crossable[tn] {
				t.Errorf("%s: result of type %s cannot cross the gopy boundary", name, tn)
			}
			if tn == "error" {
				if len(field.Names) == 1 {
					errName = field.Names[0].Name
				} else {
					errName = "?"
				}
			}
		}
		if errName == "" {
			if len(fd.Body.List) != 1 {
				t.Errorf("%s: has no error result, so it cannot report a recovered panic; keep it a single return statement or add an error result", name)
			} else if _, ok := fd.Body.List[0].(*ast.ReturnStmt); !ok {
				t.Errorf("%s: has no error result and is not a single return statement", name)
			}
			continue
		}
		if nres == 1 {
			t.Errorf("%s: returns only an error; gopy's wrapper leaks a C string per call for that shape: return (ok bool, err error)", name)
		}
		if errName == "?" {
			t.Errorf("%s: its error result must be named (recoverPanic needs its address)", name)
			continue
		}
		if len(fd.Body.List) == 0 {
			t.Errorf("%s: empty body", name)
			continue
		}
		def, ok := fd.Body.List[0].(*ast.DeferStmt)
		if !ok {
			t.Errorf("%s: first statement must be `defer recoverPanic(%q, &%s)`", name, gopyName(name), errName)
			continue
		}
		call := def.Call
		if fn, ok := call.Fun.(*ast.Ident); !ok || fn.Name != "recoverPanic" || len(call.Args) != 2 {
			t.Errorf("%s: first statement must be `defer recoverPanic(%q, &%s)`", name, gopyName(name), errName)
			continue
		}
		if lit, ok := call.Args[0].(*ast.BasicLit); !ok || lit.Value != strconv.Quote(gopyName(name)) {
			t.Errorf("%s: recoverPanic must be given its Python name %q", name, gopyName(name))
		}
		if u, ok := call.Args[1].(*ast.UnaryExpr); !ok || u.Op != token.AND || typeName(u.X) != errName {
			t.Errorf("%s: recoverPanic must be given &%s", name, errName)
		}
	}
}

func TestGopyName(t *testing.T) {
	for goName, want := range map[string]string{
		"BeginCapture": "begin_capture", "TriggerPanicForTest": "trigger_panic_for_test",
		"LiveGraphs": "live_graphs", "CudaHeaderVersion": "cuda_header_version", "PassGraph": "pass_graph",
	} {
		if got := gopyName(goName); got != want {
			t.Errorf("gopyName(%s) = %s, want %s", goName, got, want)
		}
	}
}

// panicDriver panics in every call.
type panicDriver struct{}

func (panicDriver) BeginCapture(uintptr, cudagraph.Mode) error { panic("driver boom") }
func (panicDriver) EndCapture(uintptr) (cudagraph.RawGraph, error) {
	panic("driver boom")
}
func (panicDriver) Instantiate(cudagraph.RawGraph) (cudagraph.RawExec, error) {
	panic("driver boom")
}
func (panicDriver) Launch(cudagraph.RawExec, uintptr) error { panic("driver boom") }
func (panicDriver) Upload(cudagraph.RawExec, uintptr) error { panic("driver boom") }
func (panicDriver) DestroyExec(cudagraph.RawExec) error     { panic("driver boom") }
func (panicDriver) DestroyGraph(cudagraph.RawGraph) error   { panic("driver boom") }
func (panicDriver) IsCapturing(uintptr) (cudagraph.CaptureStatus, error) {
	panic("driver boom")
}
func (panicDriver) ExchangeMode(cudagraph.Mode) (cudagraph.Mode, error) { panic("driver boom") }
func (panicDriver) NodeCount(cudagraph.RawGraph) (int, error)           { panic("driver boom") }
func (panicDriver) EventCreate(uintptr) (cudagraph.RawEvent, error)     { panic("driver boom") }
func (panicDriver) EventRecord(cudagraph.RawEvent, uintptr) error       { panic("driver boom") }
func (panicDriver) StreamWaitEvent(uintptr, cudagraph.RawEvent) error   { panic("driver boom") }
func (panicDriver) DriverVersion() (int, error)                         { panic("driver boom") }
func (panicDriver) DeviceCount() (int, error)                           { panic("driver boom") }
func (panicDriver) DeviceName(int) (string, error)                      { panic("driver boom") }
func (panicDriver) DeviceTotalMemory(int) (int64, error)                { panic("driver boom") }

// swapCore replaces the process-wide graph registry and ledger (and, with
// a nil registry, the plan store) for one test.
func swapCore(t *testing.T, e *cudagraph.Registry, l *state.Ledger) {
	t.Helper()
	oldE, oldL, oldS := graphs, passes, store
	graphs, passes = e, l
	if e == nil {
		store = nil
	}
	t.Cleanup(func() { graphs, passes, store = oldE, oldL, oldS })
}

// surface calls every export of gograph.go that has an error result and
// returns the errors by Python name.
func surface() map[string]error {
	const s = 0x7f00_0000_2000
	errs := map[string]error{}
	_, errs["driver_version"] = DriverVersion()
	_, errs["device_count"] = DeviceCount()
	_, errs["device_name"] = DeviceName(0)
	_, errs["device_total_memory"] = DeviceTotalMemory(0)
	_, errs["begin_capture"] = BeginCapture(s, 0)
	_, errs["end_capture"] = EndCapture(s)
	_, errs["abort_capture"] = AbortCapture(s)
	_, errs["capture_status"] = CaptureStatus(s)
	_, errs["exchange_capture_mode"] = ExchangeCaptureMode(0)
	_, errs["upload_graph"] = UploadGraph(1, s)
	_, errs["launch_graph"] = LaunchGraph(1, s)
	_, errs["destroy_graph"] = DestroyGraph(1)
	_, errs["graph_node_count"] = GraphNodeCount(1)
	_, errs["new_pass"] = NewPass(0, "x")
	_, errs["begin_pass_capture"] = BeginPassCapture(1, 0, "pool", 0, 0)
	_, errs["end_pass_capture"] = EndPassCapture(1, 0, 0)
	_, errs["abort_pass_capture"] = AbortPassCapture(1, 0, 0)
	_, errs["seal_pass"] = SealPass(1)
	_, errs["replay"] = Replay(1, 0, s)
	_, errs["pass_state"] = PassState(1)
	_, errs["pass_graph"] = PassGraph(1, 0)
	_, errs["reset_pass"] = ResetPass(1)
	_, errs["pass_reset_error"] = PassResetError(1)
	_, errs["drop_pass"] = DropPass(1)
	_, errs["plan_schedule"] = PlanSchedule("", "", 1, 1, true, 1)
	_, errs["plan_steps"] = PlanSteps(1)
	_, errs["plan_warmup"] = PlanWarmup(1, 1, false, false, true)
	_, errs["plan_capture"] = PlanCapture(1, "", false, false, false, false)
	_, errs["plan_memory"] = PlanMemory(1, "")
	_, errs["set_replay_recarve_spec"] = SetReplayRecarveSpec(1, 0, "")
	_, errs["replay_clobbers"] = ReplayClobbers(1, 0)
	_, errs["free_plan"] = FreePlan(1)
	_, errs["trigger_panic_for_test"] = TriggerPanicForTest()
	return errs
}

// TestNilCorePanicsComeBackAsErrors removes the engine and the ledger, so
// every call above dereferences nil inside Go: each must return an error
// naming its Python name and "internal panic", never crash.
func TestNilCorePanicsComeBackAsErrors(t *testing.T) {
	swapCore(t, nil, nil)
	for name, err := range surface() {
		if err == nil || !strings.HasPrefix(err.Error(), name+": internal panic: ") {
			t.Errorf("%s: got %v, want a recovered panic", name, err)
		}
	}
}

// TestDriverPanicsLeaveConsistentState: a driver that panics in every call.
// The panics come back as errors (recovered at the driver boundary, so the
// registry's bookkeeping runs its error paths), and afterwards nothing is
// stuck: no stream marked capturing, no graph registered, no pass alive.
func TestDriverPanicsLeaveConsistentState(t *testing.T) {
	e := cudagraph.NewRegistry(panicDriver{})
	l := state.NewLedger(e)
	swapCore(t, e, l)
	for name, err := range surface() {
		switch {
		case strings.HasSuffix(name, "_pass") || strings.HasPrefix(name, "pass_") || strings.Contains(name, "_pass_") ||
			strings.HasPrefix(name, "plan_") || name == "free_plan" || name == "replay":
			// pass records (eager: stream 0, graph 0) and plans never reach the driver
		case name == "trigger_panic_for_test":
			if err == nil || !strings.HasPrefix(err.Error(), name+": internal panic: ") {
				t.Errorf("%s: %v", name, err)
			}
		case err == nil:
			t.Errorf("%s: succeeded on a panicking driver", name)
		case strings.Contains(err.Error(), "internal panic") && !strings.HasPrefix(err.Error(), name+": "):
			t.Errorf("%s: error does not start with the Python name: %v", name, err)
		}
	}
	const s = 0x7f00_0000_3000
	for i := 0; i < 3; i++ { // a panicking begin must not leave the stream marked busy
		_, err := BeginCapture(s, 0)
		if err == nil || !strings.Contains(err.Error(), "internal panic") || strings.Contains(err.Error(), "already capturing") {
			t.Fatalf("BeginCapture #%d: %v", i, err)
		}
	}
	if n := e.Capturing(); n != 0 {
		t.Errorf("%d streams left marked capturing", n)
	}
	if n := LiveGraphs(); n != 0 {
		t.Errorf("LiveGraphs = %d", n)
	}
	// Pass records over the panicking engine: eager (0) graphs never reach
	// the driver, so the lifecycle works; the records are dropped cleanly.
	p, err := NewPass(0, "p")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := BeginPassCapture(p, 0, "pool", s, 0); err == nil || !strings.Contains(err.Error(), "internal panic") || PoolRefs("pool") != 0 {
		t.Fatalf("BeginPassCapture on a panicking driver: %v (pool refs %d)", err, PoolRefs("pool"))
	}
	if _, err := BeginPassCapture(p, 0, "pool", 0, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := EndPassCapture(p, 0, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := SealPass(p); err != nil {
		t.Fatal(err)
	}
	if _, err := Replay(p, 0, s); err != nil {
		t.Fatal(err)
	}
	if refs, err := ResetPass(p); refs != 1 || err != nil {
		t.Fatalf("ResetPass = %d, %v", refs, err)
	}
	if _, err := DropPass(p); err != nil {
		t.Fatal(err)
	}
	if n := LivePasses(); n != 0 {
		t.Errorf("LivePasses = %d", n)
	}
}

// panicGraphs is a state.Graphs whose captures work (EndCapture hands out
// handles from 11) but whose launch and destroy panic.
type panicGraphs struct{ next *int64 }

func (panicGraphs) BeginCapture(int64, int) error { return nil }
func (g panicGraphs) EndCapture(int64) (int64, error) {
	*g.next++
	return *g.next, nil
}
func (panicGraphs) AbortCapture(int64) error  { return nil }
func (panicGraphs) Launch(int64, int64) error { panic("graphs boom") }
func (panicGraphs) Order(int64, int64) error  { panic("graphs boom") }
func (panicGraphs) Destroy(int64) error       { panic("graphs boom") }

// TestGraphPanicsDuringResetReturnPoolRefs: a panic while a reset destroys
// the pass's graphs still resets it and hands back every pool reference
// (the caller must release them; losing them would leak the pool), and the
// failure is kept for PassResetError instead of swallowing the count.
func TestGraphPanicsDuringResetReturnPoolRefs(t *testing.T) {
	next := int64(10)
	l := state.NewLedger(panicGraphs{&next})
	swapCore(t, graphs, l)
	p, _ := NewPass(2, "layer2")
	for kind := 0; kind < 2; kind++ {
		if _, err := BeginPassCapture(p, kind, "pool", 5, 0); err != nil {
			t.Fatal(err)
		}
		if _, err := EndPassCapture(p, kind, 5); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := SealPass(p); err != nil {
		t.Fatal(err)
	}
	if _, err := Replay(p, 0, 1); err == nil || !strings.Contains(err.Error(), "internal panic") {
		t.Fatalf("Replay: %v", err)
	}
	if ordered, err := OrderReplay(p, 0, 1); ordered || err == nil || !strings.Contains(err.Error(), "internal panic") {
		t.Fatalf("OrderReplay: %v, %v", ordered, err)
	}
	refs, err := ResetPass(p)
	if refs != 2 || err != nil {
		t.Fatalf("ResetPass = %d, %v; want the 2 refs and no exception", refs, err)
	}
	if msg, _ := PassResetError(p); !strings.Contains(msg, "internal panic") {
		t.Fatalf("PassResetError = %q", msg)
	}
	if s, _ := PassState(p); s != "reset" {
		t.Fatalf("state %q after a reset with panics", s)
	}
	if refs, err := ResetPass(p); refs != 0 || err != nil {
		t.Fatalf("second ResetPass = %d, %v", refs, err)
	}
	if _, err := DropPass(p); err != nil {
		t.Fatal(err)
	}
	if n := l.LivePasses(); n != 0 || l.PoolRefs("pool") != 0 {
		t.Fatalf("LivePasses = %d, pool refs %d", n, l.PoolRefs("pool"))
	}
}

// TestDestroyGraphRefusesPassGraphs: a graph a pass owns can only go with
// the pass's reset; destroying it directly would leave the pass launching a
// freed graph.
func TestDestroyGraphRefusesPassGraphs(t *testing.T) {
	next := int64(40)
	l := state.NewLedger(panicGraphs{&next})
	swapCore(t, graphs, l)
	p, _ := NewPass(0, "fc")
	if _, err := BeginPassCapture(p, 0, "pool", 5, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := EndPassCapture(p, 0, 5); err != nil {
		t.Fatal(err)
	}
	if _, err := DestroyGraph(41); err == nil || err.Error() != "destroy_graph: graph 41 belongs to pass "+strconv.FormatInt(p, 10)+"; reset_pass destroys it" {
		t.Fatalf("DestroyGraph(41): %v", err)
	}
	if _, err := DestroyGraph(99); err == nil || !strings.HasPrefix(err.Error(), "destroy_graph: unknown graph handle 99") {
		t.Fatalf("DestroyGraph(99): %v", err)
	}
	l.DropPass(p)
}
