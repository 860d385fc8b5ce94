/* kvwired.transport.verbs._ibv: the verbs objects the data path posts to and
 * polls, owned by compiled code so that a post or a wake-up costs one call
 * into C, not one per work request, field or completion.
 *
 * Why not pyverbs: its objects hand out no verbs handles (CQ and QPEx have
 * none), and Debian ships it without .pxd files to cimport, so compiled
 * code can only post to and poll queue pairs it created itself, in a
 * protection domain it allocated (docs/DESIGN.md, "The compiled completion
 * path"). pyverbs stays for what is not on the data path: the probe and the
 * GID table.
 *
 * Every object here is a Resource: closing one closes first what was made
 * from it (a PD closes its MRs, windows and QPs), as pyverbs does, and a
 * child keeps its parent alive, so no verbs object outlives what it needs.
 * A verbs call that fails raises VerbsError (an OSError with the errno)
 * naming the call; kvwired.transport.verbs turns it into TransportError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <infiniband/verbs.h>

static PyObject *VerbsError;

/* ------------------------------------------------------------ resources */

typedef struct Resource Resource;
typedef int (*destroy_fn)(Resource *);

struct Resource {
    PyObject_HEAD
    PyObject *weakrefs;
    PyObject *dependents; /* weakrefs to the resources made from this one */
    PyObject *parent;     /* what this one was made from (kept alive) */
    destroy_fn destroy;   /* frees the verbs object: 0 or an errno */
    const char *what;     /* the verbs call that frees it, for errors */
    int closed;
};

static PyObject *raise_errno(int err, const char *call) {
    /* OSError(errno, text): str() gives "[Errno N] call: what errno means". */
    PyObject *args = Py_BuildValue("(iN)", err, PyUnicode_FromFormat("%s: %s", call,
                                                                     strerror(err)));
    if (args != NULL) {
        PyErr_SetObject(VerbsError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static int resource_close(Resource *self);

/* Close what was made from ``self``, newest first (a QP before its MRs). */
static int close_dependents(Resource *self) {
    if (self->dependents == NULL) return 0;
    int failed = 0;
    for (Py_ssize_t i = PyList_GET_SIZE(self->dependents) - 1; i >= 0; i--) {
        PyObject *child = PyWeakref_GetObject(PyList_GET_ITEM(self->dependents, i));
        if (child != Py_None) {
            Py_INCREF(child);
            if (resource_close((Resource *)child) < 0) failed = 1;
            Py_DECREF(child);
        }
    }
    Py_CLEAR(self->dependents);
    return failed ? -1 : 0;
}

static int resource_close(Resource *self) {
    if (self->closed) return 0;
    if (close_dependents(self) < 0) return -1;
    self->closed = 1;
    int err = self->destroy != NULL ? self->destroy(self) : 0;
    if (err) {
        raise_errno(err, self->what);
        return -1;
    }
    return 0;
}

/* ``child`` is closed with ``parent`` (first, newest first). */
static int add_dependent(Resource *parent, Resource *child) {
    if (parent->closed) {
        PyErr_Format(PyExc_ValueError, "%s is closed", Py_TYPE(parent)->tp_name);
        return -1;
    }
    if (parent->dependents == NULL && (parent->dependents = PyList_New(0)) == NULL) return -1;
    PyObject *ref = PyWeakref_NewRef((PyObject *)child, NULL);
    if (ref == NULL) return -1;
    /* Drop the references of children already gone, so a long-lived parent
     * (the device's PD under many lease windows) does not grow. */
    Py_ssize_t n = PyList_GET_SIZE(parent->dependents);
    if (n >= 64) {
        PyObject *alive = PyList_New(0);
        if (alive == NULL) { Py_DECREF(ref); return -1; }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(parent->dependents, i);
            PyObject *target = PyWeakref_GetObject(item);
            if (target != Py_None && !((Resource *)target)->closed &&
                PyList_Append(alive, item) < 0) {
                Py_DECREF(alive); Py_DECREF(ref); return -1;
            }
        }
        Py_SETREF(parent->dependents, alive);
    }
    int rc = PyList_Append(parent->dependents, ref);
    Py_DECREF(ref);
    return rc;
}

/* ``child`` was made from ``parent``: closed with it, keeps it alive. */
static int adopt(Resource *parent, Resource *child) {
    if (add_dependent(parent, child) < 0) return -1;
    Py_INCREF(parent);
    child->parent = (PyObject *)parent;
    return 0;
}

static PyObject *Resource_close(Resource *self, PyObject *unused) {
    if (resource_close(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Resource_closed(Resource *self, void *unused) {
    return PyBool_FromLong(self->closed);
}

static void Resource_dealloc(Resource *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (self->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    if (resource_close(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
    Py_CLEAR(self->dependents);
    Py_CLEAR(self->parent);
    PyErr_Restore(type, value, tb);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(Resource *self) {
    if (self->closed) {
        PyErr_Format(PyExc_ValueError, "%s is closed", Py_TYPE(self)->tp_name);
        return -1;
    }
    return 0;
}

#define RESOURCE_TYPE(cname, pyname, doc, methods, members, getset, dealloc)               \
    static PyTypeObject cname##Type = {                                                  \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvwired.transport.verbs._ibv." pyname, \
        .tp_basicsize = sizeof(cname),                                                   \
        .tp_flags = Py_TPFLAGS_DEFAULT,                                                  \
        .tp_doc = doc,                                                                   \
        .tp_weaklistoffset = offsetof(Resource, weakrefs),                              \
        .tp_dealloc = (destructor)dealloc,                                               \
        .tp_init = (initproc)cname##_init,                                               \
        .tp_new = PyType_GenericNew,                                                     \
        .tp_methods = methods,                                                           \
        .tp_members = members,                                                           \
        .tp_getset = getset,                                                             \
    }

static PyGetSetDef closed_getset[] = {
    {"closed", (getter)Resource_closed, NULL, "whether close() has run", NULL},
    {NULL}};

/* -------------------------------------------------------------- context */

typedef struct {
    Resource base;
    struct ibv_context *context;
} Context;

static int Context_destroy(Resource *self) {
    Context *c = (Context *)self;
    int err = c->context != NULL ? ibv_close_device(c->context) : 0;
    c->context = NULL;
    return err ? errno : 0;
}

static int Context_init(Context *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", NULL};
    const char *name;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s", names, &name)) return -1;
    int count = 0;
    struct ibv_device **devices = ibv_get_device_list(&count);
    if (devices == NULL) {
        raise_errno(errno, "ibv_get_device_list");
        return -1;
    }
    for (int i = 0; i < count && self->context == NULL; i++)
        if (strcmp(ibv_get_device_name(devices[i]), name) == 0)
            self->context = ibv_open_device(devices[i]);
    int err = errno;
    ibv_free_device_list(devices);
    if (self->context == NULL) {
        if (err == 0) err = ENODEV;
        raise_errno(err, "ibv_open_device");
        return -1;
    }
    self->base.destroy = Context_destroy;
    self->base.what = "ibv_close_device";
    return 0;
}

static PyObject *Context_query_port(Context *self, PyObject *arg) {
    if (check_open(&self->base) < 0) return NULL;
    long port = PyLong_AsLong(arg);
    if (port == -1 && PyErr_Occurred()) return NULL;
    struct ibv_port_attr attr;
    int err = ibv_query_port(self->context, (uint8_t)port, &attr);
    if (err) return raise_errno(err, "ibv_query_port");
    return Py_BuildValue("(iiI)", (int)attr.state, (int)attr.active_mtu, attr.max_msg_sz);
}

static PyMethodDef Context_methods[] = {
    {"query_port", (PyCFunction)Context_query_port, METH_O,
     "query_port(port) -> (state, active_mtu, max_msg_sz)"},
    {"close", (PyCFunction)Resource_close, METH_NOARGS,
     "Close the device, and first everything opened on it."},
    {NULL}};

RESOURCE_TYPE(Context, "Context", "An opened RDMA device: Context(name).", Context_methods,
              NULL, closed_getset, Resource_dealloc);

/* ----------------------------------------------------- protection domain */

typedef struct {
    Resource base;
    struct ibv_pd *pd;
} ProtectionDomain;

static int PD_destroy(Resource *self) {
    ProtectionDomain *p = (ProtectionDomain *)self;
    int err = p->pd != NULL ? ibv_dealloc_pd(p->pd) : 0;
    p->pd = NULL;
    return err;
}

static int ProtectionDomain_init(ProtectionDomain *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"context", NULL};
    Context *context;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!", names, &ContextType, &context)) return -1;
    if (check_open(&context->base) < 0) return -1;
    self->pd = ibv_alloc_pd(context->context);
    if (self->pd == NULL) {
        raise_errno(errno ? errno : ENOMEM, "ibv_alloc_pd");
        return -1;
    }
    self->base.destroy = PD_destroy;
    self->base.what = "ibv_dealloc_pd";
    return adopt(&context->base, &self->base);
}

static PyMethodDef PD_methods[] = {
    {"close", (PyCFunction)Resource_close, METH_NOARGS,
     "Free the domain, and first what was registered or created in it."},
    {NULL}};

RESOURCE_TYPE(ProtectionDomain, "ProtectionDomain", "ProtectionDomain(context).", PD_methods,
              NULL, closed_getset, Resource_dealloc);

/* -------------------------------------------------------- memory region */

typedef struct {
    Resource base;
    struct ibv_mr *mr;
    uint32_t lkey, rkey;
    uint64_t address, length;
} MemoryRegion;

static int MR_destroy(Resource *self) {
    MemoryRegion *m = (MemoryRegion *)self;
    int err = m->mr != NULL ? ibv_dereg_mr(m->mr) : 0;
    m->mr = NULL;
    return err;
}

static int MemoryRegion_init(MemoryRegion *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"pd", "address", "length", "access", NULL};
    ProtectionDomain *pd;
    unsigned long long address, length;
    int access;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KKi", names, &ProtectionDomainType, &pd,
                                     &address, &length, &access))
        return -1;
    if (check_open(&pd->base) < 0) return -1;
    self->mr = ibv_reg_mr(pd->pd, (void *)(uintptr_t)address, length, access);
    if (self->mr == NULL) {
        raise_errno(errno ? errno : ENOMEM, "ibv_reg_mr");
        return -1;
    }
    self->lkey = self->mr->lkey;
    self->rkey = self->mr->rkey;
    self->address = address;
    self->length = length;
    self->base.destroy = MR_destroy;
    self->base.what = "ibv_dereg_mr";
    return adopt(&pd->base, &self->base);
}

static PyMemberDef MR_members[] = {
    {"lkey", T_UINT, offsetof(MemoryRegion, lkey), READONLY, "the local key"},
    {"rkey", T_UINT, offsetof(MemoryRegion, rkey), READONLY, "the remote key"},
    {"address", T_ULONGLONG, offsetof(MemoryRegion, address), READONLY, "its first byte"},
    {"length", T_ULONGLONG, offsetof(MemoryRegion, length), READONLY, "its size in bytes"},
    {NULL}};

static PyMethodDef MR_methods[] = {
    {"close", (PyCFunction)Resource_close, METH_NOARGS,
     "Deregister: the device refuses the keys from now on."},
    {NULL}};

RESOURCE_TYPE(MemoryRegion, "MemoryRegion",
              "MemoryRegion(pd, address, length, access): memory registered for RDMA.",
              MR_methods, MR_members, closed_getset, Resource_dealloc);

/* -------------------------------------------------------- memory window */

typedef struct {
    Resource base;
    struct ibv_mw *mw;
} MemoryWindow;

static int MW_destroy(Resource *self) {
    MemoryWindow *w = (MemoryWindow *)self;
    int err = w->mw != NULL ? ibv_dealloc_mw(w->mw) : 0;
    w->mw = NULL;
    return err;
}

static int MemoryWindow_init(MemoryWindow *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"pd", NULL};
    ProtectionDomain *pd;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!", names, &ProtectionDomainType, &pd))
        return -1;
    if (check_open(&pd->base) < 0) return -1;
    self->mw = ibv_alloc_mw(pd->pd, IBV_MW_TYPE_2);
    if (self->mw == NULL) {
        raise_errno(errno ? errno : ENOMEM, "ibv_alloc_mw");
        return -1;
    }
    self->base.destroy = MW_destroy;
    self->base.what = "ibv_dealloc_mw";
    return adopt(&pd->base, &self->base);
}

static PyObject *MW_rkey(MemoryWindow *self, void *unused) {
    if (check_open(&self->base) < 0) return NULL;
    return PyLong_FromUnsignedLong(self->mw->rkey);
}

static PyGetSetDef MW_getset[] = {
    {"rkey", (getter)MW_rkey, NULL, "the key the device gave the window", NULL},
    {"closed", (getter)Resource_closed, NULL, "whether close() has run", NULL},
    {NULL}};

static PyMethodDef MW_methods[] = {
    {"close", (PyCFunction)Resource_close, METH_NOARGS, "Free the window."},
    {NULL}};

RESOURCE_TYPE(MemoryWindow, "MemoryWindow", "MemoryWindow(pd): a type 2 memory window.",
              MW_methods, NULL, MW_getset, Resource_dealloc);

/* ------------------------------------------------------ completion queue */

typedef struct {
    Resource base;
    struct ibv_comp_channel *channel;
    struct ibv_cq *cq;
    int depth;
} CompletionQueue;

static int CQ_destroy(Resource *self) {
    CompletionQueue *q = (CompletionQueue *)self;
    int err = 0;
    if (q->cq != NULL) {
        /* ibv_destroy_cq waits until every event the channel delivered is
         * read and acknowledged: an event still pending (a failed QP's
         * flushed work requests, the loop not yet woken) would block it for
         * ever, inside the event loop. The channel is non-blocking. */
        struct ibv_cq *cq;
        void *context;
        while (ibv_get_cq_event(q->channel, &cq, &context) == 0) ibv_ack_cq_events(cq, 1);
        err = ibv_destroy_cq(q->cq);
        q->cq = NULL;
    }
    if (q->channel != NULL) {
        int channel_err = ibv_destroy_comp_channel(q->channel);
        q->channel = NULL;
        if (!err && channel_err) err = errno ? errno : channel_err;
    }
    return err;
}

static int CompletionQueue_init(CompletionQueue *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"context", "depth", NULL};
    Context *context;
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!i", names, &ContextType, &context, &depth))
        return -1;
    if (check_open(&context->base) < 0) return -1;
    self->base.destroy = CQ_destroy;
    self->base.what = "ibv_destroy_cq";
    self->channel = ibv_create_comp_channel(context->context);
    if (self->channel == NULL) {
        raise_errno(errno ? errno : ENOMEM, "ibv_create_comp_channel");
        return -1;
    }
    int flags = fcntl(self->channel->fd, F_GETFL);
    if (flags < 0 || fcntl(self->channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        raise_errno(errno, "fcntl(O_NONBLOCK) on the completion channel");
        return -1;
    }
    self->cq = ibv_create_cq(context->context, depth, NULL, self->channel, 0);
    if (self->cq == NULL) {
        raise_errno(errno ? errno : ENOMEM, "ibv_create_cq");
        return -1;
    }
    self->depth = depth;
    int err = ibv_req_notify_cq(self->cq, 0);
    if (err) {
        raise_errno(err, "ibv_req_notify_cq");
        return -1;
    }
    return adopt(&context->base, &self->base);
}

#define POLL_BATCH 64

/* Append up to ``limit`` completions to ``out`` as (wr_id, status, opcode,
 * imm) tuples, the immediate in host order; the count, or -1. */
static Py_ssize_t poll_into(CompletionQueue *self, PyObject *out, Py_ssize_t limit) {
    struct ibv_wc wc[POLL_BATCH];
    Py_ssize_t total = 0;
    while (total < limit) {
        int want = limit - total < POLL_BATCH ? (int)(limit - total) : POLL_BATCH;
        int n = ibv_poll_cq(self->cq, want, wc);
        if (n < 0) {
            raise_errno(-n > 0 ? -n : EIO, "ibv_poll_cq");
            return -1;
        }
        for (int i = 0; i < n; i++) {
            uint32_t imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
            PyObject *item = Py_BuildValue("(KiiI)", (unsigned long long)wc[i].wr_id,
                                           (int)wc[i].status, (int)wc[i].opcode, imm);
            if (item == NULL) return -1;
            int rc = PyList_Append(out, item);
            Py_DECREF(item);
            if (rc < 0) return -1;
        }
        total += n;
        if (n < want) break;
    }
    return total;
}

static PyObject *CQ_poll(CompletionQueue *self, PyObject *args) {
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    if (!PyArg_ParseTuple(args, "|n", &limit)) return NULL;
    if (check_open(&self->base) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    if (poll_into(self, out, limit) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* The channel's descriptor was readable: take its event, acknowledge it,
 * re-arm before reaping (a completion arriving meanwhile wakes us again),
 * and reap. None when there was no event after all (a spurious wake-up). */
static PyObject *CQ_woken(CompletionQueue *self, PyObject *unused) {
    if (check_open(&self->base) < 0) return NULL;
    struct ibv_cq *cq;
    void *context;
    if (ibv_get_cq_event(self->channel, &cq, &context) != 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) Py_RETURN_NONE;
        return raise_errno(errno, "ibv_get_cq_event");
    }
    ibv_ack_cq_events(cq, 1);
    int err = ibv_req_notify_cq(self->cq, 0);
    if (err) return raise_errno(err, "ibv_req_notify_cq");
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    if (poll_into(self, out, PY_SSIZE_T_MAX) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *CQ_fd(CompletionQueue *self, void *unused) {
    if (check_open(&self->base) < 0) return NULL;
    return PyLong_FromLong(self->channel->fd);
}

static PyGetSetDef CQ_getset[] = {
    {"fd", (getter)CQ_fd, NULL, "the completion channel's descriptor (non-blocking)", NULL},
    {"closed", (getter)Resource_closed, NULL, "whether close() has run", NULL},
    {NULL}};

static PyMethodDef CQ_methods[] = {
    {"poll", (PyCFunction)CQ_poll, METH_VARARGS,
     "poll([limit]) -> [(wr_id, status, opcode, imm)]: what is there, up to limit."},
    {"woken", (PyCFunction)CQ_woken, METH_NOARGS,
     "woken() -> [(wr_id, status, opcode, imm)] or None: the channel's event taken and "
     "acknowledged, the queue re-armed, then reaped."},
    {"close", (PyCFunction)Resource_close, METH_NOARGS,
     "Destroy the queue and its channel, reading any event still pending first."},
    {NULL}};

RESOURCE_TYPE(CompletionQueue, "CompletionQueue",
              "CompletionQueue(context, depth): a CQ armed on a non-blocking channel.",
              CQ_methods, NULL, CQ_getset, Resource_dealloc);

/* ----------------------------------------------------------- queue pair */

typedef struct {
    Resource base;
    struct ibv_qp *qp;
    PyObject *cq; /* kept alive: the QP reports to it */
    uint32_t qp_num;
} QueuePair;

static int QP_destroy(Resource *self) {
    QueuePair *q = (QueuePair *)self;
    int err = q->qp != NULL ? ibv_destroy_qp(q->qp) : 0;
    q->qp = NULL;
    return err;
}

static int QueuePair_init(QueuePair *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"pd", "cq", "send_depth", "recv_depth", NULL};
    ProtectionDomain *pd;
    CompletionQueue *cq;
    unsigned int send_depth, recv_depth;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!II", names, &ProtectionDomainType, &pd,
                                     &CompletionQueueType, &cq, &send_depth, &recv_depth))
        return -1;
    if (check_open(&pd->base) < 0 || check_open(&cq->base) < 0) return -1;
    struct ibv_qp_init_attr init = {
        .send_cq = cq->cq, .recv_cq = cq->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
        .cap = {.max_send_wr = send_depth, .max_recv_wr = recv_depth ? recv_depth : 1,
                .max_send_sge = 1, .max_recv_sge = 1}};
    self->qp = ibv_create_qp(pd->pd, &init);
    if (self->qp == NULL) {
        raise_errno(errno ? errno : ENOMEM, "ibv_create_qp");
        return -1;
    }
    self->qp_num = self->qp->qp_num;
    self->base.destroy = QP_destroy;
    self->base.what = "ibv_destroy_qp";
    Py_INCREF(cq);
    self->cq = (PyObject *)cq;
    /* Closed with its PD and with its CQ: whichever goes first. */
    if (adopt(&pd->base, &self->base) < 0) return -1;
    return add_dependent(&cq->base, &self->base);
}

static void QueuePair_dealloc(QueuePair *self) {
    PyObject *cq = self->cq;
    self->cq = NULL;
    Resource_dealloc(&self->base);
    Py_XDECREF(cq);
}

static int modify(QueuePair *self, struct ibv_qp_attr *attr, int mask, const char *step) {
    if (check_open(&self->base) < 0) return -1;
    int err = ibv_modify_qp(self->qp, attr, mask);
    if (err) {
        raise_errno(err, step);
        return -1;
    }
    return 0;
}

static PyObject *QP_to_init(QueuePair *self, PyObject *args) {
    int port, access;
    if (!PyArg_ParseTuple(args, "ii", &port, &access)) return NULL;
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_INIT, .pkey_index = 0,
                               .port_num = (uint8_t)port, .qp_access_flags = access};
    if (modify(self, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
               IBV_QP_ACCESS_FLAGS, "ibv_modify_qp(RESET->INIT)") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *QP_to_rtr(QueuePair *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"port", "path_mtu", "dest_qp_num", "rq_psn", "dgid",
                            "sgid_index", "min_rnr_timer", NULL};
    int port, path_mtu, sgid_index, min_rnr_timer;
    unsigned int dest_qp_num, rq_psn;
    Py_buffer dgid;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiIIy*ii", names, &port, &path_mtu,
                                     &dest_qp_num, &rq_psn, &dgid, &sgid_index, &min_rnr_timer))
        return NULL;
    if (dgid.len != 16) {
        PyBuffer_Release(&dgid);
        return PyErr_Format(PyExc_ValueError, "a GID is 16 bytes, not %zd", dgid.len);
    }
    struct ibv_qp_attr attr = {
        .qp_state = IBV_QPS_RTR, .path_mtu = (enum ibv_mtu)path_mtu,
        .dest_qp_num = dest_qp_num, .rq_psn = rq_psn, .max_dest_rd_atomic = 1,
        .min_rnr_timer = (uint8_t)min_rnr_timer,
        .ah_attr = {.is_global = 1, .port_num = (uint8_t)port,
                    .grh = {.sgid_index = (uint8_t)sgid_index, .hop_limit = 64}}};
    memcpy(attr.ah_attr.grh.dgid.raw, dgid.buf, 16);
    PyBuffer_Release(&dgid);
    if (modify(self, &attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
               "ibv_modify_qp(INIT->RTR)") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *QP_to_rts(QueuePair *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"sq_psn", "timeout", "retry_cnt", "rnr_retry", NULL};
    unsigned int sq_psn;
    int timeout, retry_cnt, rnr_retry;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Iiii", names, &sq_psn, &timeout, &retry_cnt,
                                     &rnr_retry))
        return NULL;
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_RTS, .sq_psn = sq_psn,
                               .timeout = (uint8_t)timeout, .retry_cnt = (uint8_t)retry_cnt,
                               .rnr_retry = (uint8_t)rnr_retry, .max_rd_atomic = 1};
    if (modify(self, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
               IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC, "ibv_modify_qp(RTR->RTS)") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *QP_state(QueuePair *self, PyObject *unused) {
    if (check_open(&self->base) < 0) return NULL;
    struct ibv_qp_attr attr;
    struct ibv_qp_init_attr init;
    int err = ibv_query_qp(self->qp, &attr, IBV_QP_STATE, &init);
    if (err) return raise_errno(err, "ibv_query_qp");
    return PyLong_FromLong(attr.qp_state);
}

#define CHAIN 32 /* receives per ibv_post_recv */

/* post_writes(writes, start, end, local_base, lkey, remote_base, rkey, imm,
 *             signalled)
 * Writes ``writes[start:end]`` (Write tuples: local offset, remote offset,
 * length) in order, chained in one ibv_post_send: one doorbell for the
 * burst, as the send queue's accounting expects. The post's last write
 * (index len(writes) - 1) carries ``imm`` unless it is None; ``signalled``
 * maps an index to the wr_id of the signalled work request there (the
 * others are unsignalled). Nothing is posted if any write is malformed. */
static PyObject *QP_post_writes(QueuePair *self, PyObject *args) {
    PyObject *writes, *imm_obj, *signalled;
    Py_ssize_t start, end;
    unsigned long long local_base, remote_base;
    unsigned int lkey, rkey;
    if (!PyArg_ParseTuple(args, "OnnKIKIOO!", &writes, &start, &end, &local_base, &lkey,
                          &remote_base, &rkey, &imm_obj, &PyDict_Type, &signalled))
        return NULL;
    if (check_open(&self->base) < 0) return NULL;
    PyObject *seq = PySequence_Fast(writes, "writes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (start < 0 || end > count || start > end) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_IndexError, "writes [%zd, %zd) of %zd", start, end, count);
    }
    Py_ssize_t n = end - start;
    if (n == 0) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    int with_imm = imm_obj != Py_None;
    uint32_t imm = 0;
    if (with_imm) {
        imm = (uint32_t)PyLong_AsUnsignedLong(imm_obj);
        if (PyErr_Occurred()) { Py_DECREF(seq); return NULL; }
    }
    /* One write (the common small post) needs no allocation. */
    struct ibv_send_wr one_wr;
    struct ibv_sge one_sge;
    struct ibv_send_wr *wr = n == 1 ? &one_wr : PyMem_Calloc((size_t)n, sizeof *wr);
    struct ibv_sge *sge = n == 1 ? &one_sge : PyMem_Calloc((size_t)n, sizeof *sge);
    PyObject *result = NULL;
    if (wr == NULL || sge == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = start + i;
        PyObject *w = items[at];
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 3) {
            PyErr_Format(PyExc_TypeError, "a write is (local offset, remote offset, length), "
                         "not %R", w);
            goto done;
        }
        unsigned long long local = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(w, 0));
        unsigned long long remote = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(w, 1));
        unsigned long length = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(w, 2));
        if (PyErr_Occurred()) goto done;
        memset(&wr[i], 0, sizeof wr[i]);
        sge[i] = (struct ibv_sge){.addr = local_base + local, .length = (uint32_t)length,
                                  .lkey = lkey};
        wr[i].sg_list = &sge[i];
        wr[i].num_sge = 1;
        wr[i].wr.rdma.remote_addr = remote_base + remote;
        wr[i].wr.rdma.rkey = rkey;
        if (with_imm && at == count - 1) {
            wr[i].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            wr[i].imm_data = htonl(imm);
        } else {
            wr[i].opcode = IBV_WR_RDMA_WRITE;
        }
        PyObject *key = PyLong_FromSsize_t(at);
        if (key == NULL) goto done;
        PyObject *wr_id = PyDict_GetItemWithError(signalled, key);
        Py_DECREF(key);
        if (wr_id != NULL) {
            wr[i].wr_id = PyLong_AsUnsignedLongLong(wr_id);
            if (PyErr_Occurred()) goto done;
            wr[i].send_flags = IBV_SEND_SIGNALED;
        } else if (PyErr_Occurred()) {
            goto done;
        }
        wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
    }
    struct ibv_send_wr *bad = NULL;
    int err = ibv_post_send(self->qp, wr, &bad);
    if (err) {
        raise_errno(err, "ibv_post_send");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (wr != &one_wr) PyMem_Free(wr);
    if (sge != &one_sge) PyMem_Free(sge);
    Py_DECREF(seq);
    return result;
}

/* post_receives(address, length, lkey, count): ``count`` receives, each
 * pointing at the same ``length`` bytes (a write with immediate consumes a
 * receive and writes nothing into it). */
static PyObject *QP_post_receives(QueuePair *self, PyObject *args) {
    unsigned long long address;
    unsigned int length, lkey;
    int count;
    if (!PyArg_ParseTuple(args, "KIIi", &address, &length, &lkey, &count)) return NULL;
    if (check_open(&self->base) < 0) return NULL;
    struct ibv_sge sge = {.addr = address, .length = length, .lkey = lkey};
    struct ibv_recv_wr wr[CHAIN];
    while (count > 0) {
        int n = count < CHAIN ? count : CHAIN;
        for (int i = 0; i < n; i++) {
            wr[i] = (struct ibv_recv_wr){.wr_id = 0, .sg_list = &sge, .num_sge = 1,
                                         .next = i + 1 < n ? &wr[i + 1] : NULL};
        }
        struct ibv_recv_wr *bad = NULL;
        int err = ibv_post_recv(self->qp, wr, &bad);
        if (err) return raise_errno(err, "ibv_post_recv");
        count -= n;
    }
    Py_RETURN_NONE;
}

/* bind_window(window, key, mr, address, length, access, wr_id): bind a type 2
 * window over [address, address + length) of ``mr`` under ``key`` (the
 * window's key with a new low byte), signalled. */
static PyObject *QP_bind_window(QueuePair *self, PyObject *args) {
    MemoryWindow *window;
    MemoryRegion *mr;
    unsigned int key;
    unsigned long long address, length, wr_id;
    int access;
    if (!PyArg_ParseTuple(args, "O!IO!KKiK", &MemoryWindowType, &window, &key,
                          &MemoryRegionType, &mr, &address, &length, &access, &wr_id))
        return NULL;
    if (check_open(&self->base) < 0 || check_open(&window->base) < 0 ||
        check_open(&mr->base) < 0)
        return NULL;
    struct ibv_send_wr wr = {
        .wr_id = wr_id, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED,
        .bind_mw = {.mw = window->mw, .rkey = key,
                    .bind_info = {.mr = mr->mr, .addr = address, .length = length,
                                  .mw_access_flags = (unsigned int)access}}};
    struct ibv_send_wr *bad = NULL;
    int err = ibv_post_send(self->qp, &wr, &bad);
    if (err) return raise_errno(err, "ibv_post_send(BIND_MW)");
    Py_RETURN_NONE;
}

/* invalidate(key, wr_id): a signalled local invalidate of a bound window. */
static PyObject *QP_invalidate(QueuePair *self, PyObject *args) {
    unsigned int key;
    unsigned long long wr_id;
    if (!PyArg_ParseTuple(args, "IK", &key, &wr_id)) return NULL;
    if (check_open(&self->base) < 0) return NULL;
    struct ibv_send_wr wr = {.wr_id = wr_id, .opcode = IBV_WR_LOCAL_INV,
                             .send_flags = IBV_SEND_SIGNALED, .invalidate_rkey = key};
    struct ibv_send_wr *bad = NULL;
    int err = ibv_post_send(self->qp, &wr, &bad);
    if (err) return raise_errno(err, "ibv_post_send(LOCAL_INV)");
    Py_RETURN_NONE;
}

static PyMemberDef QP_members[] = {
    {"qp_num", T_UINT, offsetof(QueuePair, qp_num), READONLY, "the queue pair's number"},
    {NULL}};

static PyMethodDef QP_methods[] = {
    {"to_init", (PyCFunction)QP_to_init, METH_VARARGS, "to_init(port, access)"},
    {"to_rtr", (PyCFunction)(void (*)(void))QP_to_rtr, METH_VARARGS | METH_KEYWORDS,
     "to_rtr(port, path_mtu, dest_qp_num, rq_psn, dgid, sgid_index, min_rnr_timer)"},
    {"to_rts", (PyCFunction)(void (*)(void))QP_to_rts, METH_VARARGS | METH_KEYWORDS,
     "to_rts(sq_psn, timeout, retry_cnt, rnr_retry)"},
    {"state", (PyCFunction)QP_state, METH_NOARGS, "state() -> the ibv_qp_state"},
    {"post_writes", (PyCFunction)QP_post_writes, METH_VARARGS,
     "post_writes(writes, start, end, local_base, lkey, remote_base, rkey, imm, signalled)"},
    {"post_receives", (PyCFunction)QP_post_receives, METH_VARARGS,
     "post_receives(address, length, lkey, count)"},
    {"bind_window", (PyCFunction)QP_bind_window, METH_VARARGS,
     "bind_window(window, key, mr, address, length, access, wr_id)"},
    {"invalidate", (PyCFunction)QP_invalidate, METH_VARARGS, "invalidate(key, wr_id)"},
    {"close", (PyCFunction)Resource_close, METH_NOARGS, "Destroy the queue pair."},
    {NULL}};

RESOURCE_TYPE(QueuePair, "QueuePair",
              "QueuePair(pd, cq, send_depth, recv_depth): an RC queue pair, in RESET.",
              QP_methods, QP_members, closed_getset, QueuePair_dealloc);

/* --------------------------------------------------------------- module */

static PyObject *wc_status_str(PyObject *module, PyObject *arg) {
    long status = PyLong_AsLong(arg);
    if (status == -1 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(ibv_wc_status_str((enum ibv_wc_status)status));
}

static PyMethodDef module_methods[] = {
    {"wc_status_str", wc_status_str, METH_O, "libibverbs' name for a completion status"},
    {NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwired.transport.verbs._ibv",
    "The verbs objects the data path posts to and polls (see the C source's header).",
    -1, module_methods};

#define ADD_INT(m, name) PyModule_AddIntConstant(m, #name, name)

PyMODINIT_FUNC PyInit__ibv(void) {
    PyTypeObject *types[] = {&ContextType, &ProtectionDomainType, &MemoryRegionType,
                             &MemoryWindowType, &CompletionQueueType, &QueuePairType};
    for (size_t i = 0; i < sizeof types / sizeof *types; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    VerbsError = PyErr_NewExceptionWithDoc(
        "kvwired.transport.verbs._ibv.VerbsError",
        "A verbs call failed: errno is its error, strerror names the call.", PyExc_OSError,
        NULL);
    if (VerbsError == NULL || PyModule_AddObjectRef(m, "VerbsError", VerbsError) < 0) goto fail;
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        const char *dot = strrchr(types[i]->tp_name, '.');
        if (PyModule_AddObjectRef(m, dot + 1, (PyObject *)types[i]) < 0) goto fail;
    }
    if (ADD_INT(m, IBV_ACCESS_LOCAL_WRITE) || ADD_INT(m, IBV_ACCESS_REMOTE_WRITE) ||
        ADD_INT(m, IBV_ACCESS_MW_BIND) || ADD_INT(m, IBV_PORT_ACTIVE) ||
        ADD_INT(m, IBV_QPS_RESET) || ADD_INT(m, IBV_QPS_INIT) || ADD_INT(m, IBV_QPS_RTR) ||
        ADD_INT(m, IBV_QPS_RTS) || ADD_INT(m, IBV_QPS_ERR) || ADD_INT(m, IBV_WC_SUCCESS) ||
        ADD_INT(m, IBV_WC_RETRY_EXC_ERR) || ADD_INT(m, IBV_WC_RNR_RETRY_EXC_ERR) ||
        ADD_INT(m, IBV_WC_REM_ACCESS_ERR) || ADD_INT(m, IBV_WC_REM_OP_ERR) ||
        ADD_INT(m, IBV_WC_REM_INV_REQ_ERR) || ADD_INT(m, IBV_WC_LOC_PROT_ERR) ||
        ADD_INT(m, IBV_WC_LOC_LEN_ERR) || ADD_INT(m, IBV_WC_LOC_QP_OP_ERR) ||
        ADD_INT(m, IBV_WC_WR_FLUSH_ERR) || ADD_INT(m, IBV_WC_GENERAL_ERR) ||
        ADD_INT(m, IBV_WC_RECV_RDMA_WITH_IMM) || ADD_INT(m, IBV_WC_BIND_MW) ||
        ADD_INT(m, IBV_WC_LOCAL_INV) || ADD_INT(m, IBV_WC_RDMA_WRITE) ||
        ADD_INT(m, IBV_MTU_256) || ADD_INT(m, IBV_MTU_512) || ADD_INT(m, IBV_MTU_1024) ||
        ADD_INT(m, IBV_MTU_2048) || ADD_INT(m, IBV_MTU_4096))
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
