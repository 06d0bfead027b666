/* The compiled speedups of the event schema (agentlog.events.schema._speedups).
 *
 * Four loops that every recorded turn runs, each the fast path of a Python
 * function that stays the reference (agentlog.events.schema.speedups selects
 * this module; the differential tests hold both to identical results):
 *
 *   pack_int32(list)      a list of exact ints, each in int32 range, as
 *                         little-endian int32 bytes (packing.pack_tokens);
 *   pack_float32(list)    a list of exact floats as little-endian float32
 *                         bytes, each rounded as struct's "<f" rounds it
 *                         (packing.pack_log_probs);
 *   all_finite_f32(buf)   whether no float32 of the buffer is NaN or
 *                         infinite (packing.all_finite);
 *   leading_identical(a, b)  how many leading items of two lists or tuples
 *                         are the very same objects (turn_delta's
 *                         _repeated_objects).
 *
 * The packers handle only the common case and return None for anything else
 * (a bool, a numpy scalar, an int past int32, a float past float32, a list
 * subclass): the Python path then packs it, or refuses it with its own
 * message. So the stored bytes and the refusals are the Python path's own.
 * leading_identical compares pointers: it neither calls __eq__ nor touches
 * the objects' reference counts, so it reads no message of the conversation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the schema's speedups write little-endian values in place: little-endian hosts only (the pure-Python path covers others)"
#endif

/* The module's API (speedups.API): raised with every change to what it exports. */
#define SPEEDUPS_API 1

/* Write ``item`` as 4 little-endian bytes at ``at``; 0 when it is not the packer's common case. */
typedef int (*put_item)(PyObject *item, char *at);

/* An exact int in int32 range (the Python path packs anything else, or says why not). */
static int put_int32(PyObject *item, char *at) {
    if (!PyLong_CheckExact(item)) {
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || v < INT32_MIN || v > INT32_MAX) {
        return 0;
    }
    int32_t word = (int32_t)v;
    memcpy(at, &word, 4);
    return 1;
}

/* An exact float within float32's range, rounded to nearest as struct's "<f" (PyFloat_Pack4)
 * rounds it; past float32, struct refuses it and numpy's path stores the infinity. */
static int put_float32(PyObject *item, char *at) {
    if (!PyFloat_CheckExact(item)) {
        return 0;
    }
    double d = PyFloat_AS_DOUBLE(item);
    float f = (float)d;
    if (isinf(f) && !isinf(d)) {
        return 0;
    }
    memcpy(at, &f, 4);
    return 1;
}

/* ``values``, an exact list, packed 4 bytes an item by ``put``; None when it is not a list or
 * ``put`` does not take one of its items. */
static PyObject *pack_list(PyObject *values, put_item put) {
    if (!PyList_CheckExact(values)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    char *at = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!put(PyList_GET_ITEM(values, i), at + 4 * i)) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    return out;
}

static PyObject *pack_int32(PyObject *self, PyObject *values) {
    return pack_list(values, put_int32);
}

static PyObject *pack_float32(PyObject *self, PyObject *values) {
    return pack_list(values, put_float32);
}

static PyObject *all_finite_f32(PyObject *self, PyObject *raw) {
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const char *at = (const char *)view.buf;
    Py_ssize_t n = view.len / 4;
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t word;
        memcpy(&word, at + 4 * i, 4);
        /* NaN and the infinities, and only they, have every exponent bit set. */
        bad |= (uint32_t)((word & 0x7f800000u) == 0x7f800000u);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(!bad);
}

static PyObject *leading_identical(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "leading_identical: expected 2 arguments (two lists or tuples), found %zd", nargs);
        return NULL;
    }
    PyObject *a = args[0], *b = args[1];
    if (!(PyList_CheckExact(a) || PyTuple_CheckExact(a)) || !(PyList_CheckExact(b) || PyTuple_CheckExact(b))) {
        PyErr_Format(PyExc_TypeError, "leading_identical: expected two lists or tuples, found %.100s and %.100s",
                     Py_TYPE(a)->tp_name, Py_TYPE(b)->tp_name);
        return NULL;
    }
    /* No Python code runs in this loop (the GIL is held), so neither sequence changes under it. */
    PyObject **ia = PySequence_Fast_ITEMS(a), **ib = PySequence_Fast_ITEMS(b);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a), m = PySequence_Fast_GET_SIZE(b), i = 0;
    if (m < n) {
        n = m;
    }
    while (i < n && ia[i] == ib[i]) {
        i++;
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"pack_int32", pack_int32, METH_O,
     "A list of exact ints in int32 range as little-endian int32 bytes; None for any other input."},
    {"pack_float32", pack_float32, METH_O,
     "A list of exact floats within float32's range as little-endian float32 bytes; None for any other input."},
    {"all_finite_f32", all_finite_f32, METH_O, "Whether no float32 of the buffer is NaN or infinite."},
    {"leading_identical", (PyCFunction)(void (*)(void))leading_identical, METH_FASTCALL,
     "How many leading items of two lists or tuples are the very same objects."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_speedups", "The compiled speedups of the event schema.", -1,
                                       methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "API", SPEEDUPS_API) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
