//go:build !cuda

package cudagraph

import (
	"errors"
	"testing"
)

func TestCPUFlavor(t *testing.T) {
	if Flavor != "cpu" || HeaderVersion != 0 {
		t.Fatalf("Flavor, HeaderVersion = %q, %d", Flavor, HeaderVersion)
	}
	r := NewRegistry(NewDriver())
	err := r.BeginCapture(stream, 0)
	if !errors.Is(err, ErrNoCUDA) || err.Error() != "begin_capture: gograph core was built without CUDA support (cpu flavor)" {
		t.Fatalf("BeginCapture: %v", err)
	}
	if r.Capturing() != 0 {
		t.Fatal("failed begin left the stream marked capturing")
	}
	if _, err := r.CaptureStatus(stream); !errors.Is(err, ErrNoCUDA) {
		t.Fatalf("CaptureStatus: %v", err)
	}
	if _, err := r.ExchangeCaptureMode(0); !errors.Is(err, ErrNoCUDA) {
		t.Fatalf("ExchangeCaptureMode: %v", err)
	}
	if err := r.AbortCapture(stream); !errors.Is(err, ErrNoCUDA) {
		t.Fatalf("AbortCapture: %v", err)
	}
	d := r.Driver()
	if _, err := d.DriverVersion(); !errors.Is(err, ErrNoCUDA) {
		t.Fatal(err)
	}
	if _, err := d.DeviceCount(); !errors.Is(err, ErrNoCUDA) {
		t.Fatal(err)
	}
}
