//go:build !cuda

// The boundary fuzz runs on the cpu flavor only: with the cuda flavor, fuzzed stream values
// would reach the real driver as pointers (raw handles are the caller's contract).

package gograph

import (
	"encoding/binary"
	"strings"
	"testing"

	"github.com/gograph/gograph/internal/cudagraph"
	"github.com/gograph/gograph/internal/state"
)

// noPanic fails when err is a recovered panic: at the boundary every
// failure must be an ordinary error naming what was wrong.
func noPanic(t *testing.T, op string, err error) {
	t.Helper()
	if err != nil && strings.Contains(err.Error(), "internal panic") {
		t.Fatalf("%s: %v", op, err)
	}
}

// FuzzBoundary drives the exported surface the way Python can: any int64
// for handles, streams, kinds, modes and indexes, any string for labels,
// in any order. It runs on a fresh engine and ledger over this build's
// driver (the cpu flavor's fails every driver call with ErrNoCUDA).
// Invariants: no call panics (a recovered panic is a failure too); pass
// states are one of the three names; a pass never launches unless ready;
// once every pass created is dropped, no pass and no graph is left.
func FuzzBoundary(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0}, "layer")
	f.Add([]byte{0, 0, 0, 0, 1, 0, 1, 1, 3, 0, 5, 1, 9, 0, 10, 0, 11, 0, 7, 0, 5, 0}, "")
	f.Add([]byte{12, 255, 13, 7, 14, 3, 15, 9, 0, 4, 2, 200, 6, 1}, "\x00\xff\"quoted\"\n")
	f.Fuzz(func(t *testing.T, data []byte, label string) {
		e := cudagraph.NewRegistry(cudagraph.NewDriver())
		swapCore(t, e, state.NewLedger(e))
		var ids []int64
		val := func(i int) int64 { // an int64 from the 8 bytes at i (wrapping), or a small one
			if i+9 <= len(data) && data[i]%4 == 0 {
				return int64(binary.LittleEndian.Uint64(data[i+1 : i+9]))
			}
			if i < len(data) {
				return int64(data[i]) - 3
			}
			return 0
		}
		pick := func(i int) int64 {
			if len(ids) > 0 && i < len(data) && data[i]%3 != 0 {
				return ids[int(data[i])%len(ids)]
			}
			return val(i)
		}
		for i := 0; i+1 < len(data); i += 2 {
			op := data[i] % 16
			a, k := pick(i+1), int(val(i+1))
			switch op {
			case 0:
				id, err := NewPass(k, label)
				noPanic(t, "new_pass", err)
				if err == nil {
					ids = append(ids, id)
				} else if k >= 0 {
					t.Fatalf("new_pass(%d) failed: %v", k, err)
				}
			case 1: // a whole eager capture transaction
				_, err := BeginPassCapture(a, k, label, 0, 0)
				noPanic(t, "begin_pass_capture", err)
				_, err = EndPassCapture(a, k, 0)
				noPanic(t, "end_pass_capture", err)
			case 2: // a begin on any stream (fails without CUDA, changing nothing)
				_, err := BeginPassCapture(a, k, label, val(i+1), k)
				noPanic(t, "begin_pass_capture", err)
			case 3:
				_, err := AbortPassCapture(a, k, val(i+1))
				noPanic(t, "abort_pass_capture", err)
				_, err = PassResetError(a)
				noPanic(t, "pass_reset_error", err)
			case 4:
				_, err := SealPass(a)
				noPanic(t, "seal_pass", err)
			case 5:
				st, _ := PassState(a)
				launched, err := Replay(a, k, val(i+1))
				noPanic(t, "replay", err)
				if err == nil && st != "ready" {
					t.Fatalf("replay of a %q pass succeeded", st)
				}
				if launched {
					t.Fatal("replay launched a graph without CUDA")
				}
			case 6:
				s, err := PassState(a)
				noPanic(t, "pass_state", err)
				if err == nil && s != "building" && s != "ready" && s != "reset" {
					t.Fatalf("pass_state = %q", s)
				}
			case 7:
				_, err := ResetPass(a)
				noPanic(t, "reset_pass", err)
			case 8:
				_, err := DropPass(a)
				noPanic(t, "drop_pass", err)
			case 9:
				_, err := PassGraph(a, k)
				noPanic(t, "pass_graph", err)
			case 10:
				_, err := BeginCapture(a, k)
				noPanic(t, "begin_capture", err)
			case 11:
				_, err := EndCapture(a)
				noPanic(t, "end_capture", err)
				_, err = AbortCapture(a)
				noPanic(t, "abort_capture", err)
			case 12:
				_, err := LaunchGraph(a, val(i+1))
				noPanic(t, "launch_graph", err)
				_, err = UploadGraph(a, val(i+1))
				noPanic(t, "upload_graph", err)
			case 13:
				_, err := DestroyGraph(a)
				noPanic(t, "destroy_graph", err)
				_, err = GraphNodeCount(a)
				noPanic(t, "graph_node_count", err)
			case 14:
				_, err := CaptureStatus(a)
				noPanic(t, "capture_status", err)
				_, err = ExchangeCaptureMode(k)
				noPanic(t, "exchange_capture_mode", err)
			case 15:
				_, err := DeviceName(k)
				noPanic(t, "device_name", err)
				_, err = DeviceTotalMemory(k)
				noPanic(t, "device_total_memory", err)
			}
		}
		for _, id := range ids {
			if _, err := DropPass(id); err != nil {
				t.Fatalf("drop_pass(%d): %v", id, err)
			}
		}
		if n := PoolRefs(label); n != 0 {
			t.Fatalf("PoolRefs(%q) = %d after dropping every pass", label, n)
		}
		if n := LivePasses(); n != 0 {
			t.Fatalf("LivePasses = %d after dropping every pass", n)
		}
		if n := LiveGraphs(); n != 0 {
			t.Fatalf("LiveGraphs = %d", n)
		}
	})
}

// FuzzPlanBoundary feeds arbitrary text and counts to the planning exports
// (the parsers behind them have their own fuzz targets in internal/schedule
// and internal/lifetime; this one holds the boundary): no call panics, every
// error names its function, equal inputs give equal outputs, and every plan
// made is freed.
func FuzzPlanBoundary(f *testing.F) {
	f.Add("", "", 2, 2, true, 3, "facts v1\npass 0 1 0 1 -1 -1\nin 0 0 1 1 1\nout 0 0 1\n", byte(7))
	f.Add("1,2,-2,-1", "", 2, 2, true, 1, "facts v1\nin 0 0 1 1 1\nin 1 0 1 1 1\n", byte(1))
	f.Add("1,1,-1,-1", "*2", 2, 4, true, 0, "facts v1\npass 1 1 1 0 0 0\n", byte(3))
	f.Add("1,-1.5,-1", "1,1", 2, 2, false, -1, "garbage", byte(0))
	f.Fuzz(func(t *testing.T, order, layers string, n, m int, training bool, warm int, facts string, flags byte) {
		n, m = n%4096, m%4096 // keep plans small; huge counts are checked by the schedule's own tests
		before := LivePlans()
		plan, err := PlanSchedule(order, layers, n, m, training, warm)
		noPanic(t, "plan_schedule", err)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "plan_schedule: ") {
				t.Fatalf("plan_schedule error without its name: %v", err)
			}
			plan = int64(warm) // an arbitrary handle then
		}
		for _, h := range []int64{plan, plan + 1} {
			steps, err := PlanSteps(h)
			noPanic(t, "plan_steps", err)
			w1, err := PlanWarmup(h, warm%8, flags&8 != 0, flags&16 != 0, flags&32 != 0)
			noPanic(t, "plan_warmup", err)
			c1, err := PlanCapture(h, facts, flags&1 != 0, flags&2 != 0, flags&4 != 0, flags&64 != 0)
			noPanic(t, "plan_capture", err)
			if err != nil && !strings.HasPrefix(err.Error(), "plan_capture: ") {
				t.Fatalf("plan_capture error without its name: %v", err)
			}
			s2, _ := PlanSteps(h)
			w2, _ := PlanWarmup(h, warm%8, flags&8 != 0, flags&16 != 0, flags&32 != 0)
			c2, _ := PlanCapture(h, facts, flags&1 != 0, flags&2 != 0, flags&4 != 0, flags&64 != 0)
			if steps != s2 || w1 != w2 || c1 != c2 {
				t.Fatal("planning is not deterministic")
			}
		}
		if _, err := FreePlan(plan); err != nil {
			t.Fatal(err)
		}
		if LivePlans() != before {
			t.Fatalf("LivePlans = %d, want %d", LivePlans(), before)
		}
	})
}
